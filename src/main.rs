//! `ezero`: the command-line front end (train, bench).

mod cli;

use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOC: elastic_zero::runtime::alloc::HugePages = elastic_zero::runtime::alloc::HugePages;

fn main() -> ExitCode {
    elastic_zero::runtime::alloc::keep_freed_memory();
    // Before any thread starts: UCX reads its process-wide settings from the environment.
    #[cfg(feature = "ucx")]
    elastic_zero::runtime::transport::ucx::prepare_environment();
    let args = cli::Cli::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("EZERO_LOG").unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(cli::CliError::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
        Err(cli::CliError::Failed(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(1)
        }
    }
}
