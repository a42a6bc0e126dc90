//! `fluxgate`: benchmarks and tools on top of the library.

mod baseline;
mod bench;

use clap::{Parser, Subcommand};

/// Flink's network stack on io_uring: benchmarks and cluster tools.
#[derive(Debug, Parser)]
#[command(name = "fluxgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure throughput of the data path (the default command).
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    // No subcommand runs the default benchmark, as the README's first command does.
    let command = cli
        .command
        .or(Cli::parse_from(["fluxgate", "bench"]).command);
    let result = match command {
        Some(Command::Bench(args)) => bench::run(&args),
        None => unreachable!("`bench` parses to a command"),
    };
    if let Err(error) = result {
        eprintln!("fluxgate: {error}");
        std::process::exit(1);
    }
}
