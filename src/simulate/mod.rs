//! `tollgate simulate`: replay a JSON access log through a config's routes and limits, with
//! the limiter's own arithmetic on the log's clock, and report what that config would have
//! done: admitted and rejected per route and limit, the identities most rejected, and what
//! the log does not hold enough of to replay.
//!
//! Each line is replayed at its request's arrival (its timestamp, written when the response
//! ended, less its duration): lines are reordered by arrival within `REORDER_US`, since a
//! slow response is logged after faster ones that arrived later. Identities come from the
//! line: the address, host, method and path as logged, every other source from the digests of
//! `tollgate.keys`, so a bucket is one per identity as live, under a key of its own.

mod known;
mod line;
mod report;

use std::collections::{BinaryHeap, HashMap};
use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

use http::{Request, Version};

use crate::config::settings::RouteSpec;
use crate::config::Settings;
use crate::limiter::{self, ban::BanEvent, local, Limit, Outcome};
use known::Known;
use line::{Record, Skip};
use report::{LimitStats, RouteStats, Totals};

/// How long before the newest response's end a request may have arrived and still be
/// replayed in order: the longest request duration replayed exactly, and the window of lines
/// held in memory.
const REORDER_US: i64 = 300_000_000;

/// Why a concurrency limit is not replayed.
const CONCURRENCY: &str = "a concurrency limit counts requests in flight: the log gives that \
    time only for requests the live proxy served, not for what it refused (or for how long a \
    request refused here would have run); the route's other limits are replayed as if it \
    admitted every request";

/// How the report is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Replay the access log at `log` (`-`: stdin) through the config at `config`; the report.
pub fn run(config: &Path, log: &Path, format: Format) -> Result<Replayed, String> {
    // The very file a `candidate:` names replays as well as the live config.
    let settings = crate::config::load_routes(config).map_err(|e| e.to_string())?;
    let input: Box<dyn BufRead> = if log == Path::new("-") {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(log)
            .map_err(|e| format!("cannot read the log {}: {e}", log.display()))?;
        Box::new(std::io::BufReader::new(file))
    };
    let mut replay = Replay::new(&settings);
    replay
        .read(input)
        .map_err(|e| format!("reading {}: {e}", log.display()))?;
    let (config, log) = (config.display().to_string(), log.display().to_string());
    let report = match format {
        Format::Text => report::text(&config, &log, &replay.totals, &replay.stats),
        Format::Json => format!(
            "{:#}\n",
            report::json(&config, &log, &replay.totals, &replay.stats)
        ),
    };
    let t = &replay.totals;
    // Nothing replayed from a log that had lines: say why, beside the report.
    let nothing = (t.replayed == 0 && t.lines > 0).then(|| {
        if t.not_json == t.lines {
            format!(
                "nothing replayed: none of the {} lines of {log} is JSON; `tollgate simulate` \
                 reads the JSON access log (run tollgate with `--access-log-format json`)",
                t.lines
            )
        } else {
            format!(
                "nothing replayed from the {} lines of {log}: the report says why",
                t.lines
            )
        }
    });
    Ok(Replayed { report, nothing })
}

/// What `run` made: the report, and why nothing was replayed when nothing was (the command
/// then fails, after printing the report).
#[derive(Debug)]
pub struct Replayed {
    pub report: String,
    pub nothing: Option<String>,
}

/// A replay under way: the config's limits with buckets of their own, and the counts.
struct Replay<'s> {
    settings: &'s Settings,
    /// Per route, in file order: its limits, live objects counting the replay.
    limits: Vec<Vec<Arc<Limit>>>,
    stats: Vec<RouteStats>,
    totals: Totals,
    /// The latest arrival replayed so far.
    replayed_to: i64,
    /// Route index by name, for the live route a line names.
    by_name: HashMap<&'s str, usize>,
}

/// A line waiting to be replayed in arrival order (`seq` keeps file order among equals).
struct Pending {
    at: i64,
    seq: u64,
    rec: Record,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    /// Reversed: `BinaryHeap` pops the greatest, and the earliest arrival goes first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl<'s> Replay<'s> {
    fn new(settings: &'s Settings) -> Self {
        let limiter = &settings.limiter;
        let limits = settings
            .routes
            .iter()
            .map(|r| {
                r.limits
                    .iter()
                    .map(|l| {
                        // The exhaustion policy's caps, as `runtime` builds them.
                        let buckets = if l.key.one_per_address() {
                            local::Buckets::new(limiter.max_buckets)
                        } else {
                            local::Buckets::capped_per_peer(
                                limiter.max_buckets,
                                limiter.max_buckets_per_peer,
                            )
                        };
                        let buckets = Arc::new(buckets.with_quota(l.quota.clone()));
                        Arc::new(Limit::new(l, buckets).with_bans(l, None, limiter.max_buckets))
                    })
                    .collect()
            })
            .collect();
        let stats = settings
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| route_stats(settings, i, r))
            .collect();
        Self {
            settings,
            limits,
            stats,
            totals: Totals::default(),
            replayed_to: i64::MIN,
            by_name: (settings.routes.iter().enumerate())
                .map(|(i, r)| (&*r.name, i))
                .collect(),
        }
    }

    /// Replay every line of `input`, in arrival order within the reorder window.
    fn read(&mut self, mut input: impl BufRead) -> std::io::Result<()> {
        let mut pending = BinaryHeap::new();
        let (mut newest_end, mut seq) = (i64::MIN, 0u64);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            if input.read_until(b'\n', &mut buf)? == 0 {
                break;
            }
            let rec = match line::parse(&buf) {
                Ok(Some(rec)) => rec,
                Ok(None) => continue,
                Err(skip) => {
                    self.totals.lines += 1;
                    match skip {
                        Skip::NotJson => self.totals.not_json += 1,
                        Skip::NotAccess => self.totals.not_access += 1,
                        Skip::Malformed => self.totals.malformed += 1,
                    }
                    continue;
                }
            };
            self.totals.lines += 1;
            newest_end = newest_end.max(rec.end_us);
            seq += 1;
            pending.push(Pending {
                at: rec.arrival_us,
                seq,
                rec,
            });
            while pending
                .peek()
                .is_some_and(|p| p.at < newest_end.saturating_sub(REORDER_US))
            {
                if let Some(p) = pending.pop() {
                    self.replay(&p.rec);
                }
            }
        }
        while let Some(p) = pending.pop() {
            self.replay(&p.rec);
        }
        Ok(())
    }

    /// Route one line and decide it against its route's limits.
    fn replay(&mut self, rec: &Record) {
        // Refused live before any limit was asked: the replay has no operators' bans.
        if rec.outcome.as_deref() == Some("operator-ban") {
            self.totals.operator_banned += 1;
            return;
        }
        if rec.arrival_us < self.replayed_to {
            self.totals.late += 1;
        }
        self.replayed_to = self.replayed_to.max(rec.arrival_us);
        let live = rec.route.as_deref().and_then(|name| self.by_name.get(name));
        let live = live.and_then(|&i| self.settings.table.matcher(i));
        let Some(req) = request(rec, live) else {
            self.totals.refused += 1;
            return;
        };
        let Some(i) = self.settings.table.find(&req) else {
            self.totals.unrouted += 1;
            return;
        };
        let known = Known {
            rec,
            req: &req,
            fold_path: self.settings.routes[i].fold_path,
        };
        if decide(&self.limits[i], &known, &mut self.stats[i]) {
            self.totals.replayed += 1;
        } else {
            self.totals.unreplayable += 1;
        }
    }
}

/// A route's counts before any line.
fn route_stats(settings: &Settings, i: usize, r: &RouteSpec) -> RouteStats {
    let matches_headers = settings
        .table
        .matcher(i)
        .is_some_and(|m| !m.headers.is_empty());
    let limits = r
        .limits
        .iter()
        .map(|l| LimitStats {
            name: l.name.to_string(),
            key: l.key.to_string(),
            not_replayed: l.concurrency.is_some().then_some(CONCURRENCY),
            ..LimitStats::default()
        })
        .collect();
    RouteStats {
        name: r.name.to_string(),
        matches_headers,
        limits,
        ..RouteStats::default()
    }
}

/// The logged request as the proxy routed it: screened (host and path in their canonical
/// form), without a body, with the header conditions of `live`, the route the live proxy
/// gave it (the log holds no header values).
fn request(rec: &Record, live: Option<&crate::route::Matcher>) -> Option<Request<()>> {
    let mut req = Request::builder()
        .method(rec.method.clone())
        .uri(rec.path.as_str())
        .version(if rec.host.is_some() {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        });
    if let Some(host) = &rec.host {
        req = req.header(http::header::HOST, host.as_str());
    }
    for (name, value) in live.map(|m| m.headers.as_slice()).unwrap_or_default() {
        req = req.header(name, value);
    }
    let mut req = req.body(()).ok()?;
    crate::screen::screen(&mut req, usize::MAX, true).ok()?;
    Some(req)
}

/// Decide one routed line against `limits`, counting into `stats`. Returns whether it was
/// replayed (`false`: a source some limit reads is not in the line).
fn decide(limits: &[Arc<Limit>], known: &Known<'_>, stats: &mut RouteStats) -> bool {
    let rec = known.rec;
    let live = rec.route.as_deref() == Some(stats.name.as_str());
    if live {
        stats.live_requests += 1;
        if rec.live_rejected() {
            stats.live_rejected += 1;
            let by = rec.limit.as_deref();
            if let Some(l) = stats
                .limits
                .iter_mut()
                .find(|l| Some(l.name.as_str()) == by)
            {
                l.live_rejected += 1;
            }
        }
    }
    let mut clients: limiter::Small<Option<crate::identity::ClientId>> = limiter::Small::new();
    let mut alts: limiter::Small<Option<usize>> = limiter::Small::new();
    let mut unknown = false;
    for (limit, l) in limits.iter().zip(&mut stats.limits) {
        let resolved = if limit.concurrency.is_some() {
            Ok(None)
        } else {
            known.is_exempt(&limit.exempt).and_then(|exempt| {
                if exempt {
                    Ok(None)
                } else {
                    known.resolve(&limit.key).map(Some)
                }
            })
        };
        match resolved {
            Ok(id) => {
                clients.push(id.map(|(c, _)| c));
                alts.push(id.and_then(|(_, a)| a));
            }
            Err(source) => {
                *l.unknown.entry(source.to_string()).or_default() += 1;
                unknown = true;
            }
        }
    }
    if unknown {
        stats.unreplayable += 1;
        return false;
    }
    let peer = local::Peer::of(rec.client.unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into()));
    let now = limiter::Moment::from_us(rec.arrival_us as f64);
    let decision = limiter::decide_known(limits, &clients, peer, now);
    // A `count_when` limit counts the logged response's status, if this replay admits it.
    if let (true, Some(status)) = (decision.admitted(), rec.status) {
        limiter::count_known(limits, &clients, status, peer, now);
    }
    count(limits, known, &decision, &alts, stats);
    true
}

/// Count one decision into its route's and limits' counts.
fn count(
    limits: &[Arc<Limit>],
    known: &Known<'_>,
    decision: &limiter::Decision,
    alts: &[Option<usize>],
    stats: &mut RouteStats,
) {
    stats.requests += 1;
    let admitted = decision.admitted();
    if admitted {
        stats.admitted += 1;
    } else {
        stats.rejected += 1;
    }
    let first = decision.rejected_by().map(|r| r.index);
    for r in &decision.results {
        let l = &mut stats.limits[r.index];
        match r.outcome {
            Outcome::Exempt => l.exempt += 1,
            Outcome::ShadowLimited => l.shadow_rejected += 1,
            Outcome::Admitted if admitted => l.admitted += 1,
            _ => {}
        }
        if first != Some(r.index) {
            continue;
        }
        l.rejected += 1;
        if r.ban == BanEvent::Refused {
            l.banned += 1;
        }
        if let Some(client) = r.client {
            let limit = &limits[r.index];
            let entry = l
                .by_identity
                .entry(client)
                .or_insert_with(|| (known.label(&limit.key, alts[r.index]), 0));
            entry.1 += 1;
        }
    }
}

#[cfg(test)]
mod tests;
