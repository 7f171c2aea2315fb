//! The `ftrec` command line.

mod bench_ckpt;
mod bench_cluster;
mod bench_cpr;
mod bench_ec;
mod ckpt;
mod ckpt_cluster;
mod cli;
mod cluster;
mod commands;
mod progress;

use clap::Parser;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FTREC_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = cli::Cli::parse();
    match commands::run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
