//! The `tollgate` binary: parse the command line, start logging, hand over to the library.

use std::fmt::Write as _;
use std::io::IsTerminal;

/// mimalloc: the request path allocates many small, short-lived buffers (headers, futures),
/// which it serves faster than glibc's malloc.
#[global_allocator]
static GLOBAL: tollgate_alloc::Allocator = tollgate_alloc::Allocator;
use std::process::ExitCode;

use clap::Parser;
use tollgate::cli::{Cli, Command, LogFormat};

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    init_logging(&cli);
    match cli.command.take().unwrap_or(Command::Run) {
        Command::Check => match tollgate::config::load(&cli.config) {
            Ok(snapshot) => {
                print!("{}", tollgate::cli::summary(&snapshot));
                println!("{}: ok", cli.config.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        },
        Command::Completions { shell } => {
            printed(tollgate::cli::completions(shell, &mut std::io::stdout()))
        }
        Command::Man => printed(tollgate::cli::man(&mut std::io::stdout())),
        Command::Schema => printed(std::io::Write::write_all(
            &mut std::io::stdout(),
            tollgate::config::schema::text().as_bytes(),
        )),
        Command::Health { url } => match tollgate::health::check(&cli.config, url.as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("unhealthy: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Run => {
            let format = match cli.access_log_format.unwrap_or(cli.log_format) {
                LogFormat::Text => tollgate::access_log::Format::Text,
                LogFormat::Json => tollgate::access_log::Format::Json,
            };
            if let Err(e) = tollgate::access_log::install(&cli.access_log, format) {
                let at = match &cli.access_log {
                    tollgate::access_log::Destination::File(path) => format!(" {}", path.display()),
                    _ => String::new(),
                };
                return failed(&cli, &format!("cannot open the access log{at}: {e}"));
            }
            // The control runtime (signals, reload, admin, Redis); requests are served by
            // the worker threads `app::run` starts.
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return failed(&cli, &format!("cannot start the runtime: {e}")),
            };
            match runtime.block_on(tollgate::app::run(&cli.config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => failed(&cli, &e.to_string()),
            }
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
fn failed(cli: &Cli, message: &str) -> ExitCode {
    match cli.log_format {
        LogFormat::Text => eprintln!("tollgate: {message}"),
        LogFormat::Json if tracing::enabled!(tracing::Level::ERROR) => {
            tracing::error!("{message}");
        }
        // Logging is off, yet the reason the process ends is said, as an object too.
        LogFormat::Json => eprintln!(
            r#"{{"level":"ERROR","target":"tollgate","message":"{}"}}"#,
            json_escaped(message)
        ),
    }
    ExitCode::FAILURE
}

/// `s` as the inside of a JSON string.
fn json_escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

fn init_logging(cli: &Cli) {
    // Checked when the command line was parsed (`cli::log_filter`).
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        // The event's fields beside timestamp, level, target and message, not under `fields`.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}
