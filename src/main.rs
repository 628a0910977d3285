//! The `tollgate` binary: parse the command line, start logging, hand over to the library.

use std::io::IsTerminal;

/// mimalloc: the request path allocates many small, short-lived buffers (headers, futures),
/// which it serves faster than glibc's malloc.
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static GLOBAL: tollgate_alloc::Allocator = tollgate_alloc::Allocator;
use std::process::ExitCode;

use clap::Parser;
use tollgate::cli::{Cli, Command, LogFormat, RunArgs, RunOptions};

fn main() -> ExitCode {
    // Before the runtime and its buffers allocate: see the function's documentation.
    tollgate_alloc::without_huge_pages();
    let mut cli = Cli::parse();
    let command = cli.command.take().unwrap_or_default();
    let opts = match &command {
        Command::Run(args) => args.clone(),
        _ => RunArgs::default(),
    }
    .resolve(std::mem::take(&mut cli.run));
    // A replay's limits would log each ban they start, and an explanation's Redis client its
    // connections: their reports say what happened, and nothing else goes to the terminal.
    if !matches!(command, Command::Simulate { .. } | Command::Explain(_)) {
        init_logging(&opts);
    }
    match command {
        Command::Check => check(&cli.config),
        Command::Completions { shell } => {
            printed(tollgate::cli::completions(shell, &mut std::io::stdout()))
        }
        Command::Man { dir: None } => printed(tollgate::cli::man(&mut std::io::stdout())),
        Command::Man { dir: Some(dir) } => match tollgate::cli::man_pages(&dir) {
            Ok(files) => {
                for file in files {
                    println!("{}", file.display());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!(
                    "tollgate: cannot write the manual pages to {}: {e}",
                    dir.display()
                );
                ExitCode::FAILURE
            }
        },
        Command::Schema => written(
            Ok::<_, String>(tollgate::config::schema::text()),
            "tollgate",
        ),
        Command::Health { url } => match tollgate::probe::check(&cli.config, url.as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("unhealthy: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Explain(args) => written(
            tollgate::explain::cli::run(&cli.config, &args.into_args()),
            "tollgate explain",
        ),
        Command::Simulate { log, format } => simulate(&cli.config, &log, format),
        Command::Run(_) => run(&cli.config, &opts),
    }
}

/// `tollgate simulate`: the report, and a failure when nothing was replayed (said why).
fn simulate(
    config: &std::path::Path,
    log: &std::path::Path,
    format: tollgate::simulate::Format,
) -> ExitCode {
    match tollgate::simulate::run(config, log, format) {
        Ok(replayed) => {
            let code = written(Ok::<_, String>(replayed.report), "tollgate");
            match replayed.nothing {
                Some(why) => {
                    eprintln!("tollgate: {why}");
                    ExitCode::FAILURE
                }
                None => code,
            }
        }
        Err(e) => written(Err::<String, _>(e), "tollgate"),
    }
}

/// `tollgate check`: the config's summary, or every problem it has.
fn check(config: &std::path::Path) -> ExitCode {
    match tollgate::config::load(config) {
        Ok(snapshot) if snapshot.candidate_error().is_some() => {
            if let Some(e) = snapshot.candidate_error() {
                eprintln!("{e}");
            }
            ExitCode::FAILURE
        }
        Ok(snapshot) => {
            for warning in snapshot.warnings() {
                eprintln!("warning: {warning}");
            }
            print!("{}", tollgate::cli::summary(&snapshot));
            println!("{}: ok", config.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate run`: the access log opened, then the proxy served until a signal stops it.
fn run(config: &std::path::Path, opts: &RunOptions) -> ExitCode {
    let format = match opts.access_log_format {
        LogFormat::Text => tollgate::access_log::Format::Text,
        LogFormat::Json => tollgate::access_log::Format::Json,
    };
    if let Err(e) = tollgate::access_log::install(&opts.access_log, format) {
        let at = match &opts.access_log {
            tollgate::access_log::Destination::File(path) => format!(" {}", path.display()),
            _ => String::new(),
        };
        return failed(opts, &format!("cannot open the access log{at}: {e}"));
    }
    // The control runtime (signals, reload, admin, Redis); requests are served by the worker
    // threads `app::run` starts.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return failed(opts, &format!("cannot start the runtime: {e}")),
    };
    match runtime.block_on(tollgate::app::run(config, opts.address_file.as_deref())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failed(opts, &e.to_string()),
    }
}

/// A command's text on stdout, or its error on stderr after `who: `.
fn written(text: Result<impl AsRef<str>, impl std::fmt::Display>, who: &str) -> ExitCode {
    match text {
        Ok(text) => printed(std::io::Write::write_all(
            &mut std::io::stdout(),
            text.as_ref().as_bytes(),
        )),
        Err(e) => {
            eprintln!("{who}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The exit code of printing to stdout: a closed pipe (`| head`) is not a failure.
fn printed(result: std::io::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A failure of `run`: one line on stderr, a JSON object with `--log-format json`.
fn failed(opts: &RunOptions, message: &str) -> ExitCode {
    match opts.log_format {
        LogFormat::Text => eprintln!("tollgate: {message}"),
        LogFormat::Json if tracing::enabled!(tracing::Level::ERROR) => {
            tracing::error!("{message}");
        }
        // Logging is off, yet the reason the process ends is said, as an object too.
        LogFormat::Json => eprintln!(
            "{}",
            serde_json::json!({"level": "ERROR", "target": "tollgate", "message": message})
        ),
    }
    ExitCode::FAILURE
}

fn init_logging(opts: &RunOptions) {
    // Checked when the command line was parsed (`cli::log_filter`).
    let filter = tracing_subscriber::EnvFilter::try_new(&opts.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match opts.log_format {
        LogFormat::Text => {
            let no_color = std::env::var_os("NO_COLOR");
            let ansi = (opts.color).ansi(std::io::stderr().is_terminal(), no_color.as_deref());
            builder.with_ansi(ansi).init();
        }
        // The event's fields beside timestamp, level, target and message, not under `fields`.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}
