//! `fluxgate`: benchmarks and tools on top of the library.

mod affinity;
mod baseline;
mod bench;
mod cluster;
mod config_file;
mod faults;
mod netns;
mod node;
mod plot;
mod progress;
mod stress;
mod tls_certs;
mod topology;

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
    #[command(after_help = "Examples:
  fluxgate bench                                   remote 1→1, 8-byte records, with the raw-TCP baseline
  fluxgate bench --record-size 1024 --transport epoll --format lines
  fluxgate bench --local --producers 4 --consumers 4 --partitioner hash
  fluxgate bench --rate 10000 --hgrm latency.hgrm --plot latency.svg --metrics
  fluxgate bench --config network.toml             Flink option names, e.g. \"taskmanager.memory.segment-size\" = \"64kb\"")]
    Bench(bench::BenchArgs),
    /// Run a topology on a loopback cluster of node processes and verify every record.
    #[command(after_help = "Examples:
  fluxgate cluster examples/topologies/three-node.toml
  fluxgate cluster my-job.toml --timeout 120 --keep")]
    Cluster(cluster::ClusterArgs),
    /// Run one node of a cluster (what `cluster` starts; or one per host with --peers).
    // Its examples are `NodeArgs`'s after_help: one set here would hide them.
    Node(node::NodeArgs),
    /// A bounded soak: many channels, random record sizes and buffer timeouts, barriers.
    #[command(after_help = "Examples:
  fluxgate stress                                  4 nodes, 64×64 channels, 10 s
  fluxgate stress --nodes 2 --channels 16 --duration 5
  fluxgate stress --config network.toml            Flink option names for every node
  sudo fluxgate stress --netns --loss 1 --rate-limit 200   across network namespaces")]
    Stress(stress::StressArgs),
    /// Write a cluster CA and node certificates (PEM) for TLS between nodes.
    #[command(
        hide = true,
        after_help = "Example:
  fluxgate tls-certs certs/ --nodes 2    ca.pem, ca-key.pem, node-0.pem, node-0-key.pem, ..."
    )]
    TlsCerts(tls_certs::TlsCertsArgs),
}

fn main() {
    // `RUST_LOG`-style filtering (e.g. `RUST_LOG=fluxgate=debug`); warnings and errors by default.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // No subcommand runs the default benchmark, as the README's first command does.
    let command = cli
        .command
        .or(Cli::parse_from(["fluxgate", "bench"]).command);
    let result = match command {
        Some(Command::Bench(args)) => bench::run(&args),
        Some(Command::Cluster(args)) => cluster::run(&args),
        Some(Command::Node(args)) => node::run(&args),
        Some(Command::Stress(args)) => stress::run(&args),
        Some(Command::TlsCerts(args)) => tls_certs::run(&args),
        None => unreachable!("`bench` parses to a command"),
    };
    if let Err(error) = result {
        eprintln!("fluxgate: {error}");
        std::process::exit(1);
    }
}
