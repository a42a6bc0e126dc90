//! `fluxgate stress`: a bounded soak on a loopback cluster.
//!
//! Builds a topology in memory — a generator with one subtask per channel, rebalanced onto a
//! sink with as many subtasks (so `channels × channels` producer → consumer links over `nodes`
//! processes) — with random record sizes up to several segments, a random buffer timeout per
//! producer, periodic checkpoint barriers (aligned, unaligned or both) and one slow sink
//! subtask; runs it through `fluxgate cluster`'s machinery (one `fluxgate node` process per
//! node), prints the sinks' throughput every second and the cluster's verification at the end.
//!
//! With `--netns` (root only) each node runs in a network namespace of its own, behind a
//! bridge, over impaired links, authenticating with a secret made for the run (see
//! `netns.rs` and the README).
//!
//! With `--kill NODE@SECONDS` the launcher SIGKILLs nodes mid-run and the verdict is
//! `faults::verify`'s: the survivors must name the lost peer or see their partitions released
//! within `--fault-bound`, keep every record they received intact, and exit with full pools.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use fluxgate::io::Transport;
use fluxgate::NetworkConfig;

use crate::cluster::{print_summary, secs, verify, Launch, Namespaced, PlannedKill, TempDir};
use crate::config_file;
use crate::faults;
use crate::netns::{self, Impairments, Lab, SecretFile};
use crate::node::{Fault, ProgressLine};
use crate::progress::Progress;
use crate::topology::{
    mix64, CheckpointMode, CheckpointSection, ClusterSection, EdgeSection, OneOrMany, Partitioner,
    StageKind, StageSection, Topology, TopologyFile, ALIGNED_CHECKPOINT_TIMEOUT_MS, HEADER,
};

/// Options of `fluxgate stress`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:
  fluxgate stress                                  # 64 x 64 channels over 4 nodes for 10 s
  fluxgate stress --nodes 2 --channels 8 --duration 3 --checkpoints unaligned
  fluxgate stress --seed 42 --keep                 # repeatable buffer timeouts, keep the logs
  sudo fluxgate stress --netns --nodes 3 --channels 8 --duration 5 --delay 5 --loss 1 --rate-limit 200")]
pub struct StressArgs {
    /// Node processes.
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// Generator and sink parallelism: channels x channels links.
    #[arg(long, default_value_t = 64)]
    pub channels: usize,
    /// Seconds the generators emit.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// taskmanager.memory.segment-size [default: 8kb, or the --config file's].
    #[arg(long)]
    pub segment_size: Option<String>,
    /// Largest record, in segments (sizes are random from 12 bytes up to this).
    #[arg(long, default_value_t = 3)]
    pub max_record_segments: usize,
    /// Checkpoint barriers: none, aligned, unaligned, mixed (odd aligned, even unaligned), or
    /// aligned-timeout (aligned, turning unaligned after 5 ms of alignment).
    #[arg(long, value_enum, default_value_t = Barriers::Mixed)]
    pub checkpoints: Barriers,
    /// Milliseconds between checkpoint barriers.
    #[arg(long, default_value_t = 500)]
    pub checkpoint_interval: u64,
    /// Microseconds of work per record on sink subtask 0, a slow consumer (0: none).
    #[arg(long, default_value_t = 20)]
    pub slow_sink_us: u64,
    /// Seed of the buffer timeouts (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// auto | uring | epoll.
    #[arg(long)]
    pub transport: Option<Transport>,
    /// Seconds the whole run may take (default: duration + 60).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// A TOML file of Flink option names and values (e.g.
    /// `"taskmanager.network.memory.buffers-per-channel" = 4`) for every node, applied before
    /// the flags (flags win).
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<std::path::PathBuf>,
    /// Draw the credit settings the config file leaves unset from the seed (printed):
    /// `buffers-per-channel` 0, 1, 2 or 4, `floating-buffers-per-gate` 0, 1, 2 or 8,
    /// `max-buffers-per-channel` 1, 2 or 10. Soaks over seeds then cover the lean settings
    /// Flink allows, where lending floating buffers must be exact.
    #[arg(long)]
    pub vary_credit: bool,
    /// Keep the rendezvous directory (topology, node logs and reports) and print where it is.
    #[arg(long)]
    pub keep: bool,
    /// Root only: run each node in its own network namespace, the namespaces joined by veth
    /// pairs to a bridge, with impaired links (without --delay, --jitter, --loss and
    /// --rate-limit: delay 2 ms, jitter 1 ms, loss 1%). See the README.
    #[arg(long)]
    pub netns: bool,
    /// With --netns: the nodes' IPv4 /24, node i at .i+1 (default 10.X.Y.0/24 from the pid).
    #[arg(long, requires = "netns", value_name = "A.B.C.0/24")]
    pub netns_subnet: Option<String>,
    /// With --netns: delay each node's link adds to what it sends, ms (needs netem).
    #[arg(long, requires = "netns", value_name = "MS")]
    pub delay: Option<f64>,
    /// With --netns: random variation of the delay, ± ms (needs netem).
    #[arg(long, requires = "netns", value_name = "MS")]
    pub jitter: Option<f64>,
    /// With --netns: packets lost per link direction, percent (netem; else tc gact, else a
    /// u32 filter dropping 1 in 2^k packets).
    #[arg(long, requires = "netns", value_name = "PCT")]
    pub loss: Option<f64>,
    /// With --netns: most each node sends, Mbit/s (netem, else tc tbf).
    #[arg(long, requires = "netns", value_name = "MBIT")]
    pub rate_limit: Option<f64>,
    /// SIGKILL node NODE that many seconds after the nodes start (before --duration ends);
    /// repeatable. The run then verifies that the survivors detect the loss (see the README).
    #[arg(long, value_name = "NODE@SECONDS")]
    pub kill: Vec<String>,
    /// With --kill: seconds within which a survivor must see the typed error of a kill.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub fault_bound: f64,
    /// Testing the verification: one damaged record (see `fluxgate node`).
    #[arg(long, value_enum, hide = true)]
    pub inject: Option<Fault>,
}

/// Barrier choice of `stress`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Barriers {
    /// No checkpoint barriers.
    None,
    /// Aligned barriers.
    Aligned,
    /// Unaligned barriers.
    Unaligned,
    /// Odd checkpoints aligned, even ones unaligned.
    Mixed,
    /// Aligned barriers with a 5 ms alignment timeout, after which a consumer turns the
    /// checkpoint unaligned (Flink's aligned-checkpoint-timeout).
    AlignedTimeout,
}

/// Buffer timeouts a producer may draw (ms; -1 only full buffers, 0 every record).
const TIMEOUTS: [i64; 7] = [-1, 0, 1, 2, 5, 20, 100];

/// The credit settings `--vary-credit` draws from, and their choices.
const CREDIT_CHOICES: [(&str, &[&str]); 3] = [
    (
        "taskmanager.network.memory.buffers-per-channel",
        &["0", "1", "2", "4"],
    ),
    (
        "taskmanager.network.memory.floating-buffers-per-gate",
        &["0", "1", "2", "8"],
    ),
    (
        "taskmanager.network.memory.max-buffers-per-channel",
        &["1", "2", "10"],
    ),
];

/// Runs `fluxgate stress`.
pub fn run(args: &StressArgs) -> Result<(), String> {
    if args.nodes == 0 || args.channels == 0 {
        return Err("--nodes and --channels must be at least 1".into());
    }
    // Before anything is sized by it (a stage's parallelism is bounded so).
    if args.channels > crate::topology::MAX_PARALLELISM {
        return Err(format!(
            "--channels {}: at most {}",
            args.channels,
            crate::topology::MAX_PARALLELISM
        ));
    }
    if args.max_record_segments == 0 {
        return Err("--max-record-segments must be at least 1".into());
    }
    let duration = secs("duration", args.duration)?;
    if duration.is_zero() {
        return Err("--duration must be above 0".into());
    }
    let kills = faults::parse_kills(&args.kill, args.nodes, duration)?;
    let fault_bound = secs("fault-bound", args.fault_bound)?;
    // Ctrl-C or SIGTERM stop the run cleanly: nodes killed, temporary directory (and
    // namespaces, with --netns, which catches SIGHUP too) removed.
    netns::catch_interrupts(false)?;
    let timeout = match args.timeout {
        Some(t) => secs("timeout", t)?,
        None => duration + Duration::from_secs(60),
    };
    // Before anything is made or printed: root, `ip`, and sane impairments.
    let netns = if args.netns {
        Some(NetnsPlan::from_args(args)?)
    } else {
        None
    };
    // The config file's options, then the flags (flags win); all of them go to every node.
    let mut options: BTreeMap<String, String> = match &args.config {
        // Checked below, with the flags' options, all at once: a file may set what only
        // holds beside the segment size stress runs (8 KiB unless set), or several options
        // whose relation only holds once all of them are set.
        Some(path) => config_file::read_options(path)?.into_iter().collect(),
        None => BTreeMap::new(),
    };
    let segment_size = match (
        &args.segment_size,
        options.get("taskmanager.memory.segment-size"),
    ) {
        (Some(flag), _) => flag.clone(),
        (None, Some(from_file)) => from_file.clone(),
        (None, None) => "8kb".to_string(),
    };
    options.insert(
        "taskmanager.memory.segment-size".into(),
        segment_size.clone(),
    );
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let mut credit_drawn = Vec::new();
    if args.vary_credit {
        for (i, (key, choices)) in CREDIT_CHOICES.iter().enumerate() {
            if options.contains_key(*key) {
                continue;
            }
            let pick = mix64(seed ^ mix64(u64::MAX - i as u64)) % choices.len() as u64;
            let value = choices[pick as usize];
            options.insert((*key).to_string(), value.to_string());
            let short = key.rsplit('.').next().unwrap_or(key);
            credit_drawn.push(format!("{short} {value}"));
        }
    }
    let mut network = NetworkConfig::default();
    let listed: Vec<(String, String)> = options.clone().into_iter().collect();
    match &args.config {
        Some(path) => config_file::apply(path, &listed, &mut network)?,
        None => network
            .set_all(listed.iter().map(|(key, value)| (key, value)))
            .map_err(|e| format!("--segment-size: {e}"))?,
    }
    let max_size = network
        .segment_size
        .checked_mul(args.max_record_segments)
        .ok_or_else(|| {
            format!(
                "--max-record-segments {}: records that long do not fit in memory",
                args.max_record_segments
            )
        })?
        .max(HEADER);
    let timeouts: Vec<i64> = (0..args.channels as u64)
        .map(|i| TIMEOUTS[(mix64(seed ^ mix64(i)) % TIMEOUTS.len() as u64) as usize])
        .collect();

    // Dropped in reverse: the namespaces go first (after the nodes in them), then the secret,
    // then the directory.
    let dir = TempDir::new(args.keep)?;
    let mut network_options: BTreeMap<String, toml::Value> = options
        .into_iter()
        .map(|(key, value)| (key, toml::Value::String(value)))
        .collect();
    let secret = match &netns {
        Some(_) => {
            // Nodes on non-loopback addresses authenticate (`auth = auto`); `on` says so.
            let secret = SecretFile::create(dir.path())?;
            network_options.insert(
                "fluxgate.security.auth".into(),
                toml::Value::String("on".into()),
            );
            network_options.insert(
                "fluxgate.security.secret-file".into(),
                toml::Value::String(secret.path().display().to_string()),
            );
            Some(secret)
        }
        None => None,
    };
    let file = TopologyFile {
        cluster: ClusterSection {
            nodes: args.nodes,
            base_port: 0,
            transport: None,
        },
        network: network_options,
        checkpoints: match args.checkpoints {
            Barriers::None => None,
            mode => Some(CheckpointSection {
                interval_ms: args.checkpoint_interval.max(1),
                mode: match mode {
                    Barriers::Aligned => CheckpointMode::Aligned,
                    Barriers::Unaligned => CheckpointMode::Unaligned,
                    Barriers::AlignedTimeout => CheckpointMode::AlignedTimeout,
                    _ => CheckpointMode::Mixed,
                },
            }),
        },
        stages: vec![
            StageSection {
                name: "generator".into(),
                kind: StageKind::Generator,
                parallelism: args.channels,
                records: None,
                duration_ms: Some(duration.as_millis().max(1) as u64),
                record_size: None,
                min_size: Some(HEADER),
                max_size: Some(max_size),
                delay_us: None,
                slow_subtasks: None,
            },
            StageSection {
                name: "sink".into(),
                kind: StageKind::Sink,
                parallelism: args.channels,
                records: None,
                duration_ms: None,
                record_size: None,
                min_size: None,
                max_size: None,
                delay_us: (args.slow_sink_us > 0).then_some(args.slow_sink_us),
                slow_subtasks: (args.slow_sink_us > 0).then(|| vec![0]),
            },
        ],
        edges: vec![EdgeSection {
            from: "generator".into(),
            to: "sink".into(),
            partitioner: Partitioner::Rebalance,
            buffer_timeout_ms: Some(OneOrMany::Many(timeouts.clone())),
        }],
    };
    let topology = Topology::from_file(&file)?;
    let text = toml::to_string(&file).map_err(|e| format!("writing the topology: {e}"))?;
    let path = dir.path().join("stress.toml");
    std::fs::write(&path, text).map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;

    let mut drawn = timeouts.clone();
    drawn.sort_unstable();
    drawn.dedup();
    println!(
        "stress: {} nodes, {} x {} channels (rebalance), {:.1} s, records {} B to {} KiB, segments {} KiB",
        args.nodes,
        args.channels,
        args.channels,
        duration.as_secs_f64(),
        HEADER,
        max_size / 1024,
        network.segment_size / 1024,
    );
    println!(
        "        buffer timeouts (ms) drawn from {:?}, checkpoints {}, slow sink: {}, seed {seed}",
        drawn,
        match args.checkpoints {
            Barriers::None => "none".to_string(),
            Barriers::Aligned => format!("aligned every {} ms", args.checkpoint_interval),
            Barriers::Unaligned => format!("unaligned every {} ms", args.checkpoint_interval),
            Barriers::Mixed => format!(
                "aligned and unaligned in turn every {} ms",
                args.checkpoint_interval
            ),
            Barriers::AlignedTimeout => format!(
                "aligned with a {ALIGNED_CHECKPOINT_TIMEOUT_MS} ms alignment timeout every {} ms",
                args.checkpoint_interval
            ),
        },
        if args.slow_sink_us > 0 {
            format!("subtask 0 at {} us/record", args.slow_sink_us)
        } else {
            "none".into()
        },
    );
    if !credit_drawn.is_empty() {
        println!(
            "        credit drawn from the seed: {}",
            credit_drawn.join(", ")
        );
    }
    let lab = match netns {
        Some(plan) => Some(plan.build(args.nodes, secret.as_ref())?),
        None => None,
    };
    let launch = Launch {
        topology_path: &path,
        dir: dir.path(),
        nodes: args.nodes,
        timeout,
        stall_timeout: 30.0,
        transport: args.transport,
        inject: args.inject,
        namespaces: lab.as_ref().map(|lab| Namespaced {
            ip: lab.ip_program(),
            nodes: &lab.nodes,
        }),
        cancel: Some(&netns::INTERRUPTED),
        kills: &kills,
    };
    if !kills.is_empty() {
        print_planned_kills(&kills, fault_bound);
    }
    let mut last = (Duration::ZERO, 0u64, 0u64);
    // On a terminal, a bar over the generators' time; the lines print above it.
    let bar = Progress::new(&[("stress", duration)]);
    bar.phase("stress");
    let outcome = launch.run(&mut |elapsed, progress: &[ProgressLine]| {
        let records: u64 = progress.iter().map(|p| p.sink_records).sum();
        let bytes: u64 = progress.iter().map(|p| p.sink_bytes).sum();
        let dt = (elapsed - last.0).as_secs_f64().max(1e-9);
        bar.suspend(|| {
            println!(
                "  {:5.1} s  {:>10} records/s  {:>8.1} MiB/s  {:>12} records in total",
                elapsed.as_secs_f64(),
                format!("{:.0}", (records.saturating_sub(last.1)) as f64 / dt),
                (bytes.saturating_sub(last.2)) as f64 / (1u64 << 20) as f64 / dt,
                records
            )
        });
        last = (elapsed, records, bytes);
    });
    drop(bar);
    let outcome = outcome?;
    if let Some(lab) = &lab {
        match lab.counters() {
            Ok(c) => println!(
                "impair: during the run: {} packets dropped by the loss filter, {} by the qdiscs ({} held back for the rate), {} TCP segments retransmitted",
                c.filter_dropped, c.qdisc_dropped, c.qdisc_overlimits, c.tcp_retransmitted
            ),
            Err(error) => println!("impair: counters not read: {error}"),
        }
    }
    if !kills.is_empty() {
        let verification = faults::verify(&topology, &outcome, &kills, fault_bound);
        verification.print();
        if args.keep {
            println!("topology, node logs and reports: {}", dir.path().display());
        }
        return verification.verdict();
    }
    let verification = verify(&topology, &outcome);
    print_summary(&topology, &outcome, &verification);
    if args.keep {
        println!("topology, node logs and reports: {}", dir.path().display());
    }
    verification.verdict()
}

fn print_planned_kills(kills: &[PlannedKill], bound: Duration) {
    let planned: Vec<String> = kills
        .iter()
        .map(|k| format!("node {} at {:.2} s", k.node, k.after.as_secs_f64()))
        .collect();
    println!(
        "kill:   SIGKILL {}; survivors must name the lost peer (ConnectionLost) or see their partition Released within {:.1} s",
        planned.join(", "),
        bound.as_secs_f64()
    );
}

/// What `--netns` will build, checked before anything is.
#[derive(Debug)]
struct NetnsPlan {
    tools: netns::Tools,
    subnet: [u8; 3],
    impairments: Impairments,
}

impl NetnsPlan {
    fn from_args(args: &StressArgs) -> Result<Self, String> {
        let given = [args.delay, args.jitter, args.loss, args.rate_limit];
        let impairments = if given.iter().all(Option::is_none) {
            DEFAULT_IMPAIRMENTS
        } else {
            Impairments {
                delay_ms: args.delay.unwrap_or(0.0),
                jitter_ms: args.jitter.unwrap_or(0.0),
                loss_pct: args.loss.unwrap_or(0.0),
                rate_mbit: args.rate_limit,
            }
        };
        impairments.validate()?;
        let subnet = match &args.netns_subnet {
            Some(text) => netns::parse_subnet(text)?,
            None => netns::subnet_for(std::process::id()),
        };
        let tools = netns::preflight()?;
        Ok(Self {
            tools,
            subnet,
            impairments,
        })
    }

    /// Builds the namespaces, impairs their links and says what it did (and, loudly on
    /// stderr, what it could not do).
    fn build(self, nodes: usize, secret: Option<&SecretFile>) -> Result<Lab, String> {
        netns::catch_interrupts(true)?;
        let mut lab = Lab::build(self.tools, nodes, self.subnet)?;
        let applied = lab.impair(&self.impairments)?;
        let [a, b, c] = self.subnet;
        println!(
            "netns:  namespaces {prefix}hub (a bridge) and {prefix}node0..{last}, one veth pair each to the bridge; node i at {a}.{b}.{c}.i+1/24",
            prefix = lab.prefix(),
            last = nodes - 1,
        );
        if let Some(secret) = secret {
            println!(
                "auth:   on, a random secret in {} (0600, removed at the end)",
                secret.path().display()
            );
        }
        println!(
            "impair: {}",
            if applied.applied.is_empty() {
                "none".to_string()
            } else {
                applied.applied.join("; ")
            }
        );
        if let Some(missing) = &applied.missing {
            eprintln!("fluxgate: WARNING: {missing}");
        }
        Ok(lab)
    }
}

/// `--netns` without impairment options.
const DEFAULT_IMPAIRMENTS: Impairments = Impairments {
    delay_ms: 2.0,
    jitter_ms: 1.0,
    loss_pct: 1.0,
    rate_mbit: None,
};
