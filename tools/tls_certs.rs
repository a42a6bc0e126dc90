//! `fluxgate tls-certs DIR`: a fresh cluster CA and node certificates for
//! `security.ssl.internal.*` (benchmarks, tests, small clusters), with the options to set.

use std::path::PathBuf;

use clap::Args;
use fluxgate::io::tls::{write_cluster_files, DEFAULT_SSL_SERVER_NAME};

/// Options of `fluxgate tls-certs`.
#[derive(Debug, Args)]
pub struct TlsCertsArgs {
    /// Directory to write into (created if missing; files there of the same names are
    /// replaced).
    dir: PathBuf,
    /// Node certificates to issue.
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// The name node certificates carry (`security.ssl.internal.server-name`).
    #[arg(long, default_value = DEFAULT_SSL_SERVER_NAME)]
    server_name: String,
}

/// Writes the files and prints, per node, the options that use them (TOML, as `--config`
/// files take them).
pub fn run(args: &TlsCertsArgs) -> Result<(), String> {
    let files = write_cluster_files(&args.dir, args.nodes, &args.server_name)
        .map_err(|error| error.to_string())?;
    println!(
        "# cluster CA: {} (its key {} issues nodes; keep it off them)",
        files.ca_file.display(),
        files.ca_key_file.display()
    );
    for (index, (cert, key)) in files.nodes.iter().enumerate() {
        println!("\n# node {index}");
        println!("\"security.ssl.internal.enabled\" = \"true\"");
        println!(
            "\"security.ssl.internal.cert-file\" = {:?}",
            cert.display().to_string()
        );
        println!(
            "\"security.ssl.internal.key-file\" = {:?}",
            key.display().to_string()
        );
        println!(
            "\"security.ssl.internal.ca-file\" = {:?}",
            files.ca_file.display().to_string()
        );
        if args.server_name != DEFAULT_SSL_SERVER_NAME {
            println!(
                "\"security.ssl.internal.server-name\" = {:?}",
                args.server_name
            );
        }
    }
    Ok(())
}
