//! The command line: `run` (the default), `check`, `health`, `explain`, `simulate`,
//! `completions`, `man` and `schema`.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::settings::{ActionSpec, Rate, RouteSpec};
use crate::config::Settings;
use crate::route::{HostPattern, Matcher, PathPattern};

/// The version `--version` prints: the package's, and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TOLLGATE_COMMIT"),
    ")"
);

#[derive(Debug, Parser)]
#[command(name = "tollgate", version = VERSION, about = "A rate-limiting reverse proxy")]
pub struct Cli {
    /// Config file.
    #[arg(
        long,
        short,
        global = true,
        env = "TOLLGATE_CONFIG",
        default_value = "config/tollgate.yaml"
    )]
    pub config: PathBuf,
    /// Options of `run`, also accepted before it (or with no command, `run` being the default).
    #[command(flatten)]
    pub run: RunArgs,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What only `run` reads: logging and the access log. Not global, so `check --help` and
/// `health --help` list only what those commands use. Unset values fall back to the ones given
/// before the command, then to the defaults (`RunArgs::resolve`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunArgs {
    /// Log level or filter (error, warn, info, debug, trace, or a tracing filter) [default: info].
    #[arg(long, env = "TOLLGATE_LOG", value_parser = log_filter)]
    pub log_level: Option<String>,
    /// Log format: text or json (one JSON object per line) [default: text].
    #[arg(long, env = "TOLLGATE_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Where the access log goes: stderr (or true), stdout, a file path, or off (or false)
    /// [default: stderr].
    #[arg(long, env = "TOLLGATE_ACCESS_LOG", value_parser = crate::access_log::Destination::parse)]
    pub access_log: Option<crate::access_log::Destination>,
    /// Access-log format: text or json [default: the --log-format].
    #[arg(long, env = "TOLLGATE_ACCESS_LOG_FORMAT")]
    pub access_log_format: Option<LogFormat>,
    /// Once serving, write the bound addresses to this file (`listener ADDR` and `admin ADDR`
    /// lines), for supervisors and tests that bind port 0 (as Envoy's --admin-address-path).
    #[arg(long, env = "TOLLGATE_ADDRESS_FILE")]
    pub address_file: Option<std::path::PathBuf>,
    /// Colour in the text log: auto (on a terminal, unless `NO_COLOR` is set), always or never
    /// [default: auto].
    #[arg(long, env = "TOLLGATE_COLOR")]
    pub color: Option<Color>,
}

/// `RunArgs` with every value decided.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub log_level: String,
    pub log_format: LogFormat,
    pub access_log: crate::access_log::Destination,
    pub access_log_format: LogFormat,
    pub address_file: Option<std::path::PathBuf>,
    pub color: Color,
}

/// When the text log is coloured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Color {
    /// On a terminal, unless `NO_COLOR` is set to anything but the empty string (no-color.org).
    #[default]
    Auto,
    Always,
    Never,
}

impl Color {
    /// Whether to colour output going to a terminal (`terminal`), given `NO_COLOR`'s value.
    pub fn ansi(self, terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
        match self {
            Self::Always => true,
            Self::Never => false,
            Self::Auto => terminal && no_color.is_none_or(std::ffi::OsStr::is_empty),
        }
    }
}

impl Default for Command {
    fn default() -> Self {
        Self::Run(RunArgs::default())
    }
}

impl RunArgs {
    /// These values, else those of `outer` (given before the command), else the defaults.
    pub fn resolve(self, outer: Self) -> RunOptions {
        let log_format = self
            .log_format
            .or(outer.log_format)
            .unwrap_or(LogFormat::Text);
        RunOptions {
            log_level: self
                .log_level
                .or(outer.log_level)
                .unwrap_or_else(|| "info".to_owned()),
            log_format,
            access_log: self
                .access_log
                .or(outer.access_log)
                .unwrap_or(crate::access_log::Destination::Stderr),
            access_log_format: self
                .access_log_format
                .or(outer.access_log_format)
                .unwrap_or(log_format),
            address_file: self.address_file.or(outer.address_file),
            color: self.color.or(outer.color).unwrap_or_default(),
        }
    }
}

/// A log level or tracing filter, checked: a typo is an error, not a filter that silently
/// logs nothing (`warnn` would be read as a target name).
fn log_filter(s: &str) -> Result<String, String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let expected = "expected off, error, warn, info, debug, trace, or directives such as \
                    `info,tollgate=debug`";
    let is_level = |l: &str| LEVELS.iter().any(|x| x.eq_ignore_ascii_case(l.trim()));
    for directive in s.split(',').filter(|d| !d.trim().is_empty()) {
        let level = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
        if !is_level(level) {
            return Err(format!("`{}` is not a level: {expected}", level.trim()));
        }
    }
    tracing_subscriber::EnvFilter::try_new(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("{e}: {expected}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (the default).
    Run(RunArgs),
    /// Validate the config, print a summary, and exit non-zero on any error.
    Check,
    /// Ask the admin listener of the config's proxy for /healthz: exit 0 when healthy. For
    /// container health checks, where the image has no shell or curl.
    Health {
        /// Ask this URL instead of the config's admin address.
        #[arg(long)]
        url: Option<String>,
    },
    /// Print a completion script for SHELL (bash, zsh, fish, elvish, powershell) to stdout.
    Completions { shell: clap_complete::Shell },
    /// Print the manual page (roff) to stdout, as in `tollgate man > tollgate.1`; with
    /// `--dir`, write one page per command there instead (tollgate.1, tollgate-run.1, ...).
    Man {
        /// The directory to write every page to.
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
    },
    /// Print the config's JSON Schema to stdout, for editors and CI (docs/configuration.md).
    Schema,
    /// Explain what the proxy would do with a request now (route, each limit's identity and
    /// bucket, the decision), without counting it: asks a running proxy's admin API with
    /// `--admin`, else reads the config alone (every bucket full).
    Explain(ExplainArgs),
    /// Replay a JSON access log through the config's routes and limits and report what they
    /// would have admitted and rejected (docs/operations.md, "Replaying traffic").
    Simulate {
        /// The access log (JSON lines, as `--access-log-format json` writes them); `-` reads
        /// stdin.
        #[arg(long)]
        log: PathBuf,
        /// The report: text, or one JSON object for scripts.
        #[arg(long, value_enum, default_value = "text")]
        format: crate::simulate::Format,
    },
}

/// Write the completion script of `shell` to `out`. Made in memory first: clap_complete
/// panics on a failed write (a closed pipe, as in `| head`).
pub fn completions(
    shell: clap_complete::Shell,
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    use clap::CommandFactory;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "tollgate", &mut script);
    out.write_all(&script)
}

/// Write the manual page to `out`.
pub fn man(out: &mut dyn std::io::Write) -> std::io::Result<()> {
    use clap::CommandFactory;
    clap_mangen::Man::new(Cli::command()).render(out)
}

/// Write the manual pages to `dir`: `tollgate.1`, and `tollgate-COMMAND.1` for each command.
/// Returns the files written.
pub fn man_pages(dir: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    use clap::CommandFactory;
    let top = Cli::command();
    let mut written = Vec::new();
    let mut write = |cmd: clap::Command, name: String| -> std::io::Result<()> {
        let path = dir.join(format!("{name}.1"));
        let mut file = std::fs::File::create(&path)?;
        // Named as the file, invoked as typed (`tollgate run`).
        let invoked = name.replacen('-', " ", 1);
        clap_mangen::Man::new(cmd.name(name).bin_name(invoked)).render(&mut file)?;
        written.push(path);
        Ok(())
    };
    for sub in top.get_subcommands().filter(|c| c.get_name() != "help") {
        write(sub.clone(), format!("tollgate-{}", sub.get_name()))?;
    }
    write(top, "tollgate".to_owned())?;
    Ok(written)
}

/// A one-line summary of every route and limit, as `tollgate check` prints it (the
/// candidate config's too).
pub fn summary(s: &Settings) -> String {
    let mut out = String::new();
    let listeners: Vec<String> = s.listeners.iter().map(|l| l.address.to_string()).collect();
    if !listeners.is_empty() || s.rls.is_none() {
        let _ = writeln!(out, "listeners: {}", listeners.join(", "));
    }
    capacity_summary(s, &mut out);
    routes_summary(s, &mut out);
    rls_summary(s, &mut out);
    traces_summary(s, &mut out);
    if let Some(c) = &s.candidate {
        if let Ok(candidate) = &c.settings {
            let _ = writeln!(
                out,
                "candidate {} (evaluated, never enforced):",
                c.path.display()
            );
            routes_summary(candidate, &mut out);
        }
    }
    out
}

/// The rate limit service: its address, then one line per domain with its file and rules.
fn rls_summary(s: &Settings, out: &mut String) {
    let Some(rls) = &s.rls else { return };
    let _ = writeln!(out, "rls (envoy.service.ratelimit.v3): {}", rls.address);
    for d in &rls.domains {
        fn count(rules: &[crate::config::settings::DescriptorSpec]) -> (usize, usize) {
            rules.iter().fold((0, 0), |(all, limited), r| {
                let (a, l) = count(&r.children);
                (all + 1 + a, limited + usize::from(r.limit.is_some()) + l)
            })
        }
        let (rules, limited) = count(&d.rules);
        let file = d.file.display();
        let _ = writeln!(
            out,
            "  domain {}: {rules} rules, {limited} with a limit ({file})",
            d.domain
        );
    }
}

/// Where traces go and which are kept.
fn traces_summary(s: &Settings, out: &mut String) {
    use crate::telemetry::OtlpProtocol;
    let Some(t) = &s.traces else { return };
    let protocol = match t.protocol {
        OtlpProtocol::HttpProtobuf => "OTLP/HTTP",
        OtlpProtocol::Grpc => "OTLP/gRPC",
    };
    let to = t
        .endpoint
        .as_deref()
        .unwrap_or("the OTEL_EXPORTER_OTLP_* endpoint");
    let refused = if t.sample_refused {
        ", every refusal"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "traces: {protocol} to {to}, sampled {} of new traces{refused}",
        t.sample_ratio
    );
}

/// One line per capped upstream: its cap per target, and its queue.
fn capacity_summary(s: &Settings, out: &mut String) {
    use crate::capacity::Cap;
    for u in &s.upstreams {
        let Some(c) = &u.capacity else { continue };
        let cap = match &c.cap {
            Cap::Fixed(n) => n.to_string(),
            Cap::Adaptive(a) => format!("adaptive {}..{}", a.min, a.max),
        };
        let key = u
            .queue_key
            .as_ref()
            .map_or("the route's limit key".to_owned(), ToString::to_string);
        let _ = writeln!(
            out,
            "upstream {}: max_in_flight {cap} per target, queue {} for {:?}, fair by {key}",
            u.name, c.queue_size, c.timeout
        );
    }
}

fn routes_summary(s: &Settings, out: &mut String) {
    let any = Matcher::default();
    for (i, r) in s.routes.iter().enumerate() {
        let m = s.table.matcher(i).unwrap_or(&any);
        let _ = writeln!(out, "route {}: {}", r.name, describe_route(r, m));
        for l in &r.limits {
            let mut flags = String::new();
            if l.cost != 1 {
                let _ = write!(flags, ", cost {}", l.cost);
            }
            if l.shadow {
                flags.push_str(", shadow");
            }
            if !l.exempt.is_empty() {
                let _ = write!(flags, ", {} exemptions", l.exempt.len());
            }
            if let Some(b) = &l.ban {
                let _ = write!(
                    flags,
                    ", ban after {} within {:?} for {:?} up to {:?}",
                    b.after, b.within, b.first, b.max
                );
            }
            if let Some(lease) = &l.leasing {
                let auto = if lease.auto { "auto, " } else { "" };
                let _ = write!(
                    flags,
                    ", leasing {auto}at most {} tokens held {:?}",
                    lease.tokens, lease.hold
                );
            }
            let shape = match &l.quota {
                Some(q) if q.is_window() => {
                    format!(
                        "window {}/{}, {}",
                        q.count,
                        q.period.describe(),
                        q.counting.as_str()
                    )
                }
                Some(q) => format!(
                    "quota {}/{} ({})",
                    q.count,
                    q.period.describe(),
                    q.tz.iana_name().unwrap_or("UTC")
                ),
                None => match &l.concurrency {
                    Some(c) => format!("{} in flight (lease {:?})", c.max, c.lease),
                    None => format!("{}, burst {}", Rate::describe(l.rate.per_sec), l.rate.burst),
                },
            };
            let _ = writeln!(
                out,
                "  limit {}: {shape}, key {}{flags}, on_failure {}",
                l.name,
                l.key,
                format!("{:?}", l.on_failure).to_lowercase()
            );
        }
    }
}

/// A rate in the largest-count unit that shows it without a leading `0.`.
fn describe_route(r: &RouteSpec, m: &Matcher) -> String {
    let methods = m.methods.as_ref().map_or("*".to_owned(), |ms| {
        ms.iter()
            .map(http::Method::as_str)
            .collect::<Vec<_>>()
            .join(",")
    });
    let host = match &m.host {
        None => String::new(),
        Some(HostPattern::Exact(h)) => h.clone(),
        Some(HostPattern::Suffix(s)) => format!("*{s}"),
    };
    let path = match &m.path {
        PathPattern::Any => "/*".to_owned(),
        PathPattern::Exact(p) => p.clone(),
        PathPattern::Prefix(p) => format!("{p}*"),
    };
    let action = match &r.action {
        ActionSpec::Forward(u) => format!("upstream {}", u.name),
        ActionSpec::Respond(resp) => format!("respond {}", resp.status.as_u16()),
    };
    let headers = if m.headers.is_empty() {
        String::new()
    } else {
        format!(" (+{} header conditions)", m.headers.len())
    };
    let priority = match r.priority {
        crate::capacity::Priority::Normal => "",
        crate::capacity::Priority::High => " (priority high)",
        crate::capacity::Priority::Low => " (priority low)",
    };
    format!("{methods} {host}{path}{headers} -> {action}{priority}")
}

/// `tollgate explain`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ExplainArgs {
    /// The admin listener of a running proxy, as in `http://127.0.0.1:9901`; without it the
    /// request is explained from the config alone (every bucket full, no bans).
    #[arg(long)]
    pub admin: Option<String>,
    /// The file holding the admin API's token (the one `admin.token_file` names).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// The request's method.
    #[arg(long, default_value = "GET")]
    pub method: String,
    /// The request's host [default: localhost].
    #[arg(long)]
    pub host: Option<String>,
    /// The request's path, with its query string if any.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// A request header, as `NAME:VALUE` (repeat for more: `--header Cookie:sid=1`).
    #[arg(long = "header", value_name = "NAME:VALUE")]
    pub headers: Vec<String>,
    /// The client address the request comes from.
    #[arg(long, default_value = "127.0.0.1")]
    pub ip: String,
    /// Explain a rate limit service call of this domain instead of a request (`rls:`).
    #[arg(long)]
    pub domain: Option<String>,
    /// A descriptor of that call, as `KEY=VALUE,KEY=VALUE` (repeat for more).
    #[arg(long = "descriptor", value_name = "KEY=VALUE,...", requires = "domain")]
    pub descriptors: Vec<String>,
    /// Print the JSON answer instead of the summary.
    #[arg(long)]
    pub json: bool,
}

impl ExplainArgs {
    /// These options as `explain`'s.
    pub fn into_args(self) -> crate::explain::cli::Args {
        crate::explain::cli::Args {
            admin: self.admin,
            token_file: self.token_file,
            query: crate::explain::Query {
                method: Some(self.method),
                host: self.host,
                path: Some(self.path),
                headers: self.headers,
                ip: Some(self.ip),
                domain: self.domain,
                descriptors: self.descriptors,
            },
            json: self.json,
        }
    }
}
