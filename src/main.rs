//! The `tollgate` binary: parse the command line, start logging, hand over to the library.

use std::io::IsTerminal;

/// mimalloc: the request path allocates many small, short-lived buffers (headers, futures),
/// which it serves faster than glibc's malloc.
#[global_allocator]
static GLOBAL: tollgate_alloc::Allocator = tollgate_alloc::Allocator;
use std::process::ExitCode;

use clap::Parser;
use tollgate::cli::{Cli, Command, LogFormat};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli);
    match cli.command.unwrap_or(Command::Run) {
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
            // The control runtime (signals, reload, admin, Redis); requests are served by
            // the worker threads `app::run` starts.
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("tollgate: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(tollgate::app::run(&cli.config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("tollgate: {e}");
                    ExitCode::FAILURE
                }
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

fn init_logging(cli: &Cli) {
    let mut directives = cli.log_level.clone();
    if !cli.access_log {
        directives.push_str(",tollgate::access=off");
    }
    // Checked when the command line was parsed (`cli::log_filter`).
    let filter = tracing_subscriber::EnvFilter::try_new(&directives)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().init(),
    }
}
