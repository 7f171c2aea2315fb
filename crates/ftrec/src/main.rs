//! The `ftrec` command line.

/// `println!` for every result line of every command. A failed write returns from the
/// enclosing function with `?` instead of panicking as `println!` does, so a reader that
/// closed the pipe (`ftrec ckpt ls DIR | head -1`) ends the command quietly in `main`
/// (`is_broken_pipe`). Defined before the modules so that all of them see it.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        writeln!($crate::output::stdout(), $($arg)*)?
    }};
}

mod commands;
mod output;
mod progress;

use anyhow::Result;
use clap::{Parser, Subcommand};

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FTREC_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Cli::parse();
    match run(args) {
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

#[derive(Parser, Debug)]
#[command(name = "ftrec", version, about = "Fault-tolerant DLRM training")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a DLRM on a dataset directory.
    Train(commands::train::TrainArgs),
    /// Evaluate a saved model on a dataset's test split.
    Eval(commands::train::EvalArgs),
    /// Generate, convert and inspect datasets.
    #[command(subcommand)]
    Data(commands::data::DataCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(commands::bench::BenchCommand),
    /// Generate Criteo-shaped data, train it on a local cluster (3 erasure-coded servers and
    /// 2 workers by default; `--ft checkpoint`: 2 servers with checkpoints), SIGKILL a server
    /// mid-run, recover, and compare AUC with the teacher's.
    Demo(commands::demo::DemoArgs),
    /// Inspect, verify and restore checkpoints.
    #[command(subcommand)]
    Ckpt(commands::ckpt::CkptCommand),
    /// Run a parameter-server cluster on this host, or act on a running one.
    #[command(subcommand)]
    Cluster(commands::cluster::ClusterCommand),
    /// A parameter server process (started by `cluster run`, or by hand across hosts).
    Server(commands::cluster::ServerArgs),
    /// A worker process.
    Worker(commands::cluster::WorkerArgs),
    /// A standalone coordinator (multi-host); `cluster run` embeds one.
    Coordinator(commands::cluster::CoordinatorArgs),
    /// Plots.
    #[command(subcommand)]
    Plot(commands::cluster::PlotCommand),
}

fn run(cli: Cli) -> Result<()> {
    use commands::{bench, ckpt, cluster, data, demo, train};
    match cli.command {
        Command::Train(a) => train::train(a),
        Command::Eval(a) => train::eval(a),
        Command::Data(data::DataCommand::Gen(a)) => data::data_gen(a),
        Command::Data(data::DataCommand::Convert(a)) => data::data_convert(a),
        Command::Data(data::DataCommand::Stats(a)) => data::data_stats(a),
        Command::Bench(bench::BenchCommand::Train(a)) => bench::bench_train(a),
        Command::Bench(bench::BenchCommand::Ckpt(a)) => bench::ckpt::run(a),
        Command::Bench(bench::BenchCommand::Cluster(a)) => bench::cluster::run(a),
        Command::Bench(bench::BenchCommand::Ec(a)) => bench::ec::run(a),
        Command::Bench(bench::BenchCommand::Cpr(a)) => bench::cpr::run(a),
        Command::Bench(bench::BenchCommand::Faults(a)) => bench::faults::bench_faults(a),
        Command::Bench(bench::BenchCommand::Soak(a)) => bench::soak::bench_soak(a),
        Command::Bench(bench::BenchCommand::Coordinator(a)) => bench::coordinator::run(a),
        Command::Bench(bench::BenchCommand::Shootout(a)) => bench::shootout::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Ckpt(c) => ckpt::run(c),
        Command::Cluster(cluster::ClusterCommand::Run(a)) => cluster::run(*a),
        Command::Cluster(cluster::ClusterCommand::Kill {
            coordinator,
            job,
            member,
        }) => cluster::kill(&coordinator, job.as_deref(), &member),
        Command::Cluster(cluster::ClusterCommand::Scale(a)) => cluster::scale(a),
        Command::Cluster(cluster::ClusterCommand::VerifyParity(a)) => cluster::verify_parity(a),
        Command::Server(a) => cluster::server(a),
        Command::Worker(a) => cluster::worker(a),
        Command::Coordinator(a) => cluster::coordinator(a),
        Command::Plot(cluster::PlotCommand::Timeline { input, out, title }) => {
            cluster::plot_timeline(&input, &out, &title)
        }
    }
}
