//! The `ftrec` command line.

/// `println!` for every result line of every command. A failed write returns from the
/// enclosing function with `?` instead of panicking as `println!` does, so a reader that
/// closed the pipe (`ftrec ckpt ls DIR | head -1`) ends the command quietly in `main`
/// (`is_broken_pipe`). Defined before the modules so that all of them see it.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        writeln!($crate::commands::stdout(), $($arg)*)?
    }};
}

mod bench_ckpt;
mod bench_cluster;
mod bench_cpr;
mod bench_ec;
mod ckpt;
mod ckpt_cluster;
mod cli;
mod cluster;
mod commands;
mod demo;
mod progress;
mod timeline_plot;

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
        // A reader that went away (`ftrec data stats DIR | head -1`) ends the output, as
        // for any Unix tool: quietly. SIGPIPE stays ignored (the cluster's sockets rely on
        // it), so the write fails with EPIPE and lands here.
        Err(e) if is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
