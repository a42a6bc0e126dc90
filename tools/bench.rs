//! `fluxgate bench`: throughput and latency of an exchange.
//!
//! By default the exchange is remote: this process starts a second `fluxgate` process (the
//! same binary with the hidden `--producer-process`), whose producer threads write through
//! `RecordWriter`s into result partitions; this process's consumer threads read through
//! `RecordReader`s over input gates whose remote channels reach them over loopback TCP. With
//! `--local` both sides share one process and the channels take buffers by reference.
//!
//! * Throughput run: P producers × C consumers emit records as fast as they can for the
//!   duration; reported as records/s, payload GB/s and CPU ns per record (user + system
//!   time of both processes over the records received).
//! * Latency run: one producer, one consumer, records sent at a fixed rate with a flush after
//!   every record (`execution.buffer-timeout` = 0). Each record carries its *scheduled* send
//!   time, so a stalled sender shows up in the histogram (no coordinated omission).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fluxgate::gate::{ConsumedSubpartition, ReaderItem, RecordReader, SingleInputGate};
use fluxgate::io::Transport;
use fluxgate::metrics::{InputMetricsSnapshot, OutputMetricsSnapshot};
use fluxgate::partition::{
    BroadcastSelector, BufferTimeout, ChannelSelector, ForwardSelector, KeyHashSelector,
    RecordWriter, ResultPartition, ResultPartitionId, RoundRobinSelector, Selection,
};
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

use crate::affinity::{self, Pinning};
use crate::baseline;
use crate::config_file::apply_config_file;
use crate::plot;
use crate::progress::Progress;
use hdrhistogram::Histogram;

/// Options of `fluxgate bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Bytes per record (at least 8 for the latency run's timestamp).
    #[arg(long, default_value_t = 8)]
    record_size: usize,
    /// Producer tasks.
    #[arg(long, default_value_t = 1)]
    producers: usize,
    /// Consumer tasks.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// How records are spread over the consumers.
    #[arg(long, value_enum, default_value_t = Partitioner::RoundRobin)]
    partitioner: Partitioner,
    /// `taskmanager.memory.segment-size` in bytes [default: 32768, or the --config file's].
    #[arg(long)]
    segment_size: Option<usize>,
    /// `execution.buffer-timeout` of the throughput run in ms: -1 flush only full buffers,
    /// 0 flush every record, N flush at most N ms after a write.
    #[arg(long, default_value_t = 100, allow_hyphen_values = true)]
    buffer_timeout: i64,
    /// `fluxgate.network.io-thread.busy-poll-us` of both processes: µs an I/O thread keeps
    /// polling for work after its last work before it sleeps, trading CPU for latency (remote
    /// runs only; --local has no I/O thread) [default: 0, or the --config file's].
    #[arg(long, value_name = "US")]
    busy_poll_us: Option<u64>,
    /// Seconds of the throughput run.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Records per second of the latency run (0 skips it).
    #[arg(long, default_value_t = 10_000)]
    rate: u64,
    /// Seconds of the latency run (at the default rate, 100 000 records: p99.9 rests on the
    /// slowest 100).
    #[arg(long, default_value_t = 10.0)]
    latency_duration: f64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// One process, local channels (no network).
    #[arg(long)]
    local: bool,
    /// The driver of the remote exchange: auto | uring | epoll.
    #[arg(long, default_value = "auto")]
    transport: Transport,
    /// Run the raw-TCP baseline beside the engine (the default).
    #[arg(long, overrides_with = "no_baseline")]
    baseline: bool,
    /// Skip the raw-TCP baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Write the engine's latency distribution (µs) in HdrHistogram's `.hgrm` text format,
    /// which HdrHistogram's plotter reads.
    #[arg(long, value_name = "FILE")]
    hgrm: Option<PathBuf>,
    /// Draw latency by percentile (log scale of 1/(1-p), as HdrHistogram's plotter does) of
    /// the engine and the baseline to an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Print the final metrics of the throughput run's partitions and gates (Flink's names).
    #[arg(long)]
    metrics: bool,
    /// The throughput run's tasks emit and read one record per call (`RecordWriter::emit`,
    /// `RecordReader::next`) instead of in batches (`RecordWriter::emit_all` of 64 KiB of
    /// records, and `RecordReader::records_in_buffer` after each record read).
    #[arg(long)]
    per_record: bool,
    /// Internal: run the producer half of a remote benchmark (started by `bench` itself).
    #[arg(long, value_enum, hide = true)]
    producer_process: Option<Phase>,
    /// Pin the producer side to CPU P and the consumer side to CPU C: the producer process
    /// (its tasks and its I/O thread) and the baseline's writer on P, the consumer process
    /// and the baseline's reader on C. Remote runs only.
    #[arg(long, value_name = "P,C")]
    pin_cpus: Option<Pinning>,
    /// A TOML file of Flink option names and values (e.g.
    /// `"taskmanager.memory.segment-size" = "16kb"`), applied before the flags (flags win).
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Partitioner {
    /// Round robin (Flink's rebalance).
    RoundRobin,
    /// By a key hash (the record's first 8 bytes).
    Hash,
    /// Every record to every consumer.
    Broadcast,
    /// Producer i to consumer i (needs producers == consumers).
    Forward,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// A readable table.
    Table,
    /// One `name value unit` line per figure.
    Lines,
    /// One JSON object.
    Json,
}

/// The figures of one benchmark run (engine or baseline).
#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    records: u64,
    records_per_sec: f64,
    payload_gb_per_sec: f64,
    cpu_ns_per_record: f64,
    /// p50, p99, p99.9, max in µs.
    latency_us: Option<[f64; 4]>,
    latency_samples: u64,
}

/// The final metrics of the throughput run: one snapshot per partition and per gate.
#[derive(Debug, Default)]
struct RunMetrics {
    partitions: Vec<OutputMetricsSnapshot>,
    gates: Vec<InputMetricsSnapshot>,
}

/// Runs the benchmark and prints its figures.
pub fn run(args: &BenchArgs) -> Result<(), String> {
    if args.producers == 0 || args.consumers == 0 {
        return Err("--producers and --consumers must be at least 1".into());
    }
    if args.partitioner == Partitioner::Forward && args.producers != args.consumers {
        return Err("--partitioner forward needs as many producers as consumers".into());
    }
    if args.plot.is_some() && args.rate == 0 {
        return Err("--plot needs the latency run (--rate above 0)".into());
    }
    if args.hgrm.is_some() && args.rate == 0 {
        return Err("--hgrm needs the latency run (--rate above 0)".into());
    }
    // Durations a `Duration` and a deadline can hold, checked before anything starts.
    let latency_run = (args.rate > 0).then_some(("--latency-duration", args.latency_duration));
    for (name, secs) in [("--duration", args.duration)]
        .into_iter()
        .chain(latency_run)
    {
        if !(secs > 0.0 && secs <= MAX_RUN_SECS) {
            return Err(format!(
                "{name} {secs}: a number of seconds above 0 and at most {MAX_RUN_SECS}"
            ));
        }
    }
    BufferTimeout::try_from_millis(args.buffer_timeout)
        .map_err(|reason| format!("--buffer-timeout {}: {reason}", args.buffer_timeout))?;
    if args.rate > MAX_RATE {
        return Err(format!(
            "--rate {}: at most {MAX_RATE} records per second",
            args.rate
        ));
    }
    if args.rate > 0 && (args.rate as f64 * args.latency_duration) < 1.0 {
        return Err(format!(
            "--rate {} for --latency-duration {} sends no record",
            args.rate, args.latency_duration
        ));
    }
    if args.pin_cpus.is_some() && args.local {
        return Err("--pin-cpus pins the two processes of a remote run; --local has one".into());
    }
    let config = network_config(args)?;
    if args.record_size > config.max_record_bytes {
        // Refused before the harness sizes its record batches by it (a terabyte record would
        // abort the process on that allocation, not fail its first emit).
        return Err(format!(
            "--record-size {}: above the largest record, fluxgate.record.max-size ({} bytes)",
            args.record_size, config.max_record_bytes
        ));
    }
    if let Some(phase) = args.producer_process {
        if let Some(pinning) = args.pin_cpus {
            // Before the environment starts its I/O thread, which inherits the pinning.
            affinity::pin_current_thread(pinning.producer)?;
        }
        return producer_process(args, &config, phase);
    }
    if let Some(pinning) = args.pin_cpus {
        // Every thread of this process (the consumers, the I/O thread, the baseline's reader)
        // inherits it; the baseline's writer moves to the producer's CPU for its runs.
        affinity::pin_current_thread(pinning.consumer)?;
    }
    let baseline_runs = !args.no_baseline;
    let latency_runs = args.rate > 0;
    let plan: Vec<(&'static str, Duration)> = [
        ("throughput", args.duration, true),
        ("latency", args.latency_duration, latency_runs),
        ("baseline throughput", args.duration, baseline_runs),
        (
            "baseline latency",
            args.latency_duration,
            baseline_runs && latency_runs,
        ),
    ]
    .into_iter()
    .filter(|p| p.2)
    .map(|(name, secs, _)| (name, Duration::try_from_secs_f64(secs).unwrap_or_default()))
    .collect();
    let progress = Progress::new(&plan);
    progress.phase("throughput");
    let (mut engine, metrics, transport) = throughput(args, &config)?;
    let mut engine_histogram = None;
    if latency_runs {
        progress.phase("latency");
        let histogram = latency(args, &config)?;
        engine.latency_us = Some(percentiles(&histogram));
        engine.latency_samples = histogram.len();
        if let Some(path) = &args.hgrm {
            std::fs::write(path, hgrm(&histogram))
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        engine_histogram = Some(histogram);
    }
    let (baseline, baseline_histogram) = if baseline_runs {
        let (figures, histogram) = baseline_figures(args, &progress)?;
        (Some(figures), histogram)
    } else {
        (None, None)
    };
    drop(progress);
    if let (Some(path), Some(engine_histogram)) = (&args.plot, &engine_histogram) {
        let mut series = vec![("fluxgate", engine_histogram)];
        if let Some(histogram) = &baseline_histogram {
            series.push(("raw TCP baseline", histogram));
        }
        let title = format!(
            "fluxgate bench: latency by percentile ({} records/s, {} B records)",
            args.rate, args.record_size
        );
        plot::write_svg(path, &title, &series)?;
    }
    let metrics = args.metrics.then_some(&metrics);
    print(
        args,
        &config,
        transport,
        &engine,
        baseline.as_ref(),
        metrics,
    );
    Ok(())
}

/// Longest run a flag may ask for, in seconds (a day).
const MAX_RUN_SECS: f64 = 86_400.0;

/// Highest latency-run rate: one record per nanosecond is beyond any path.
const MAX_RATE: u64 = 1_000_000_000;

/// When record `i` of a run at `rate` records/s is due, after the run's start (exact for
/// any count: no interval rounded to whole nanoseconds and multiplied up).
pub(crate) fn scheduled(i: u64, rate: u64) -> Duration {
    Duration::from_nanos((u128::from(i) * 1_000_000_000 / u128::from(rate.max(1))) as u64)
}

/// The network configuration of both processes: the `--config` file, then the flags.
fn network_config(args: &BenchArgs) -> Result<NetworkConfig, String> {
    let mut config = NetworkConfig::default();
    let from_file = match &args.config {
        Some(path) => apply_config_file(path, &mut config)?,
        None => BTreeSet::new(),
    };
    if let Some(size) = args.segment_size {
        config
            .set("taskmanager.memory.segment-size", &size.to_string())
            .map_err(|e| format!("--segment-size: {e}"))?;
    }
    if let Some(micros) = args.busy_poll_us {
        config
            .set(
                "fluxgate.network.io-thread.busy-poll-us",
                &micros.to_string(),
            )
            .map_err(|e| format!("--busy-poll-us: {e}"))?;
    }
    if !from_file.contains("taskmanager.memory.network.max") {
        // Room for every partition's and gate's pool.
        let memory = bench_memory(args.producers, args.consumers, config.segment_size)
            .ok_or("--producers and --consumers: their pools do not fit in memory")?;
        config
            .set("taskmanager.memory.network.max", &memory.to_string())
            .map_err(|e| e.to_string())?;
    }
    Ok(config)
}

/// Network memory for every partition's and gate's pool of a run, twice over (at least
/// 64 MiB); `None` when it overflows.
fn bench_memory(producers: usize, consumers: usize, segment_size: usize) -> Option<usize> {
    let partitions = producers.checked_mul(consumers.checked_mul(2)?.checked_add(8)?)?;
    let gates = consumers.checked_mul(producers.checked_mul(2)?.checked_add(9)?)?;
    let pools = partitions.checked_add(gates)?;
    Some(
        pools
            .checked_mul(segment_size)?
            .checked_mul(2)?
            .max(64 << 20),
    )
}

fn baseline_figures(
    args: &BenchArgs,
    progress: &Progress,
) -> Result<(Figures, Option<Histogram<u64>>), String> {
    progress.phase("baseline throughput");
    let cpu_started = cpu_time();
    let moved = baseline::throughput(
        args.record_size,
        Duration::from_secs_f64(args.duration),
        args.pin_cpus,
    )
    .map_err(|e| format!("baseline: {e}"))?;
    let cpu = cpu_time().saturating_sub(cpu_started).as_secs_f64();
    let elapsed = moved.elapsed.as_secs_f64();
    let mut figures = Figures {
        records: moved.records,
        records_per_sec: moved.records as f64 / elapsed,
        payload_gb_per_sec: moved.payload_bytes as f64 / elapsed / 1e9,
        cpu_ns_per_record: cpu * 1e9 / moved.records.max(1) as f64,
        ..Figures::default()
    };
    let mut latencies = None;
    if args.rate > 0 {
        progress.phase("baseline latency");
        let histogram = baseline::latency(
            args.record_size,
            args.rate,
            Duration::from_secs_f64(args.latency_duration),
            args.pin_cpus,
        )
        .map_err(|e| format!("baseline latency: {e}"))?;
        figures.latency_us = Some(percentiles(&histogram));
        figures.latency_samples = histogram.len();
        latencies = Some(histogram);
    }
    Ok((figures, latencies))
}

/// The percentile distribution as Java HdrHistogram's `outputPercentileDistribution` prints
/// it (values in µs, 5 ticks per half distance), the format the HdrHistogram plotter parses.
fn hgrm(histogram: &Histogram<u64>) -> String {
    use std::fmt::Write as _;
    const SCALE: f64 = 1000.0; // ns → µs
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>12} {:>14} {:>10} {:>14}\n",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    );
    let mut total = 0u64;
    for step in histogram.iter_quantiles(5) {
        total += step.count_since_last_iteration();
        let quantile = step.quantile_iterated_to();
        let value = step.value_iterated_to() as f64 / SCALE;
        if quantile < 1.0 {
            let _ = writeln!(
                out,
                "{value:>12.3} {quantile:>2.12} {total:>10} {:>14.2}",
                1.0 / (1.0 - quantile)
            );
        } else {
            let _ = writeln!(out, "{value:>12.3} {quantile:>2.12} {total:>10}");
        }
    }
    let _ = writeln!(
        out,
        "#[Mean    = {:>12.3}, StdDeviation   = {:>12.3}]",
        histogram.mean() / SCALE,
        histogram.stdev() / SCALE
    );
    let _ = writeln!(
        out,
        "#[Max     = {:>12.3}, Total count    = {:>12}]",
        histogram.max() as f64 / SCALE,
        histogram.len()
    );
    let _ = writeln!(
        out,
        "#[Buckets = {:>12}, SubBuckets     = {:>12}]",
        histogram.buckets(),
        // Java's subBucketCount: the power of two covering 2 × 10^significant digits.
        (2 * 10u64.pow(u32::from(histogram.sigfig()))).next_power_of_two()
    );
    out
}

fn percentiles(histogram: &Histogram<u64>) -> [f64; 4] {
    let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
    [
        us(0.5),
        us(0.99),
        us(0.999),
        histogram.max() as f64 / 1000.0,
    ]
}

/// One exchange: the consumers' shuffle environment, and the producers either in it
/// (`--local`, local channels) or in a second process reached over loopback TCP.
struct Exchange {
    env: ShuffleEnvironment,
    producer_process: Option<ProducerProcess>,
}

fn start_env(
    args: &BenchArgs,
    config: &NetworkConfig,
    node: u128,
) -> Result<ShuffleEnvironment, String> {
    ShuffleEnvironment::start(EnvConfig {
        network: config.clone(),
        transport: args.transport,
        node,
        ..EnvConfig::default()
    })
    .map_err(|e| e.to_string())
}

/// The producers' partitions, one subpartition per consumer.
fn create_partitions(
    env: &ShuffleEnvironment,
    producers: usize,
    consumers: usize,
) -> Result<Vec<ResultPartition>, String> {
    (0..producers)
        .map(|p| env.create_partition(partition_id(p), consumers))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

fn partition_id(producer: usize) -> ResultPartitionId {
    ResultPartitionId {
        partition: producer as u64,
        producer: 0,
    }
}

impl Exchange {
    /// Starts both sides; a producer process is told the `phase` it runs and has created its
    /// partitions when this returns.
    fn new(args: &BenchArgs, config: &NetworkConfig, phase: Phase) -> Result<Self, String> {
        let producer_process = if args.local {
            None
        } else {
            Some(ProducerProcess::spawn(phase)?)
        };
        Ok(Self {
            env: start_env(args, config, 2)?,
            producer_process,
        })
    }

    /// Partitions of this process's producers (`--local`), or none (the producer process has
    /// its own).
    fn local_partitions(
        &self,
        producers: usize,
        consumers: usize,
    ) -> Result<Vec<ResultPartition>, String> {
        if self.producer_process.is_some() {
            return Ok(Vec::new());
        }
        create_partitions(&self.env, producers, consumers)
    }

    fn gate(&self, consumer: usize, producers: usize) -> Result<SingleInputGate, String> {
        let location = match &self.producer_process {
            None => ProducerLocation::Local,
            Some(process) => ProducerLocation::Remote(process.addr),
        };
        let channels: Vec<_> = (0..producers)
            .map(|producer| ChannelDescriptor {
                consumed: ConsumedSubpartition {
                    partition: partition_id(producer),
                    subpartition: consumer,
                },
                location: location.clone(),
            })
            .collect();
        self.env.create_gate(&channels).map_err(|e| e.to_string())
    }

    /// The transport the consumers' environment runs (what `auto` chose).
    fn transport(&self) -> Transport {
        self.env.transport()
    }
}

/// True once every segment of `env` is back in its pool (bounded wait: segments on their way
/// back arrive within it, or it is a leak).
fn pool_full(env: &ShuffleEnvironment) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if env.network().available_segments() == env.network().total_segments() {
            return true;
        }
        thread::sleep(Duration::from_millis(1));
    }
    false
}

/// What a producer process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Phase {
    /// P producers emit as fast as they can for `--duration` seconds.
    Throughput,
    /// One producer emits at `--rate`, flushing every record.
    Latency,
}

/// The producer half of a remote benchmark: a second `fluxgate` process, started with this
/// process's own `bench` arguments plus the hidden `--producer-process PHASE`, so both derive
/// the same configuration. It talks over its standard streams, one line each way per step:
///
/// ```text
/// child:  ready <listening address>        partitions created, server listening
/// parent: go                               the consumers' gates exist, start emitting
/// child:  done <cpu ns> <pool full 0|1> <partition metrics as JSON>
/// parent: (closes stdin)                   the consumers are done, exit
/// ```
struct ProducerProcess {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    /// The child's stdout, a line at a time, from a thread that ends when the child does:
    /// every wait for a line is bounded.
    lines: std::sync::mpsc::Receiver<String>,
    addr: std::net::SocketAddr,
}

/// Longest the producer process may take to start, and to report after the run ends.
const PRODUCER_REPLY: Duration = Duration::from_secs(60);

/// What a producer process reports at the end of its phase.
struct ProducerReport {
    cpu: Duration,
    pool_full: bool,
    partitions: Vec<OutputMetricsSnapshot>,
}

impl ProducerProcess {
    fn spawn(phase: Phase) -> Result<Self, String> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let exe =
            std::env::current_exe().map_err(|e| format!("cannot find the fluxgate binary: {e}"))?;
        // This process's own `bench` arguments (none when `fluxgate` ran with no subcommand).
        let own: Vec<String> = std::env::args()
            .skip(1)
            .skip_while(|a| a != "bench")
            .skip(1)
            .collect();
        let phase = match phase {
            Phase::Throughput => "throughput",
            Phase::Latency => "latency",
        };
        let mut child = Command::new(exe)
            .arg("bench")
            .args(own)
            .args(["--producer-process", phase])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the producer process: {e}"))?;
        let stdin = child.stdin.take();
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the producer process has no stdout".into());
        };
        let (sender, lines) = std::sync::mpsc::channel();
        // Ends at the child's exit (end of its stdout) or when nobody listens any more.
        thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut process = Self {
            child,
            stdin,
            lines,
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let line = process.line(PRODUCER_REPLY)?;
        process.addr = line
            .strip_prefix("ready ")
            .and_then(|addr| addr.trim().parse().ok())
            .ok_or_else(|| format!("the producer process said `{line}`, not `ready ADDR`"))?;
        Ok(process)
    }

    /// The producer process's next line within `timeout`; its exit is an error naming its
    /// status.
    fn line(&mut self, timeout: Duration) -> Result<String, String> {
        use std::sync::mpsc::RecvTimeoutError;
        match self.lines.recv_timeout(timeout) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => {
                Err(format!("the producer process said nothing for {timeout:?}"))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.wait()?;
                Err(format!("the producer process exited ({status})"))
            }
        }
    }

    /// Reaps the child, killing it if it has not exited within `PRODUCER_REPLY`.
    fn wait(&mut self) -> Result<std::process::ExitStatus, String> {
        let deadline = Instant::now() + PRODUCER_REPLY;
        // Bounded by the deadline; a poll every few ms, then a kill.
        loop {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                return self.child.wait().map_err(|e| e.to_string());
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    fn go(&mut self) -> Result<(), String> {
        use std::io::Write;
        let stdin = self
            .stdin
            .as_mut()
            .ok_or("the producer process has no stdin")?;
        stdin
            .write_all(b"go\n")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("the producer process is gone: {e}"))
    }

    /// Waits for the report; then lets the process exit and reaps it.
    fn finish(mut self) -> Result<ProducerReport, String> {
        let line = self.line(PRODUCER_REPLY)?;
        let report = parse_done(&line)
            .ok_or_else(|| format!("the producer process said `{line}`, not `done …`"))?;
        self.stdin = None;
        let status = self.wait()?;
        if !status.success() {
            return Err(format!("the producer process failed ({status})"));
        }
        Ok(report)
    }
}

impl Drop for ProducerProcess {
    fn drop(&mut self) {
        // A benchmark that failed on the consumer side leaves no producer behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn parse_done(line: &str) -> Option<ProducerReport> {
    let mut fields = line.trim().splitn(4, ' ');
    if fields.next()? != "done" {
        return None;
    }
    let cpu = Duration::from_nanos(fields.next()?.parse().ok()?);
    let pool_full = fields.next()? == "1";
    let partitions = serde_json::from_str(fields.next()?).ok()?;
    Some(ProducerReport {
        cpu,
        pool_full,
        partitions,
    })
}

/// `fluxgate bench --producer-process PHASE`: the producer half of a remote benchmark (see
/// [`ProducerProcess`]).
fn producer_process(args: &BenchArgs, config: &NetworkConfig, phase: Phase) -> Result<(), String> {
    use std::io::{BufRead, Write};
    let env = start_env(args, config, 1)?;
    let (producers, consumers) = match phase {
        Phase::Throughput => (args.producers, args.consumers),
        Phase::Latency => (1, 1),
    };
    let partitions = create_partitions(&env, producers, consumers)?;
    let mut out = std::io::stdout().lock();
    let mut input = std::io::stdin().lock();
    let told = |out: &mut std::io::StdoutLock, text: String| {
        writeln!(out, "{text}")
            .and_then(|()| out.flush())
            .map_err(|e| format!("the benchmark process is gone: {e}"))
    };
    told(&mut out, format!("ready {}", env.local_addr()))?;
    let mut line = String::new();
    let mut wait_for_go = || {
        input.read_line(&mut line).map_err(|e| e.to_string())?;
        if line.trim() != "go" {
            return Err("the benchmark process went away before the run".to_string());
        }
        Ok(())
    };
    let mut cpu_started = cpu_time();
    let metrics = match phase {
        Phase::Throughput => {
            wait_for_go()?;
            // Counted from the go, as the consumer side counts from once its gates exist:
            // neither counts the connection's set-up.
            cpu_started = cpu_time();
            produce_throughput(args, partitions)?
        }
        Phase::Latency => {
            let partition = partitions.into_iter().next().ok_or("no partition")?;
            produce_latency(args, partition, wait_for_go)?;
            Vec::new()
        }
    };
    let pool_full = pool_full(&env);
    let cpu = cpu_time().saturating_sub(cpu_started);
    let metrics = serde_json::to_string(&metrics).map_err(|e| e.to_string())?;
    told(
        &mut out,
        format!("done {} {} {metrics}", cpu.as_nanos(), u8::from(pool_full)),
    )?;
    // Bounded by the parent: it closes our stdin once its consumers are done (or it exits).
    while input.read_line(&mut line).is_ok_and(|n| n > 0) {}
    Ok(())
}

fn record_key(record: &[u8]) -> u64 {
    let mut key = [0u8; 8];
    let n = record.len().min(8);
    key[..n].copy_from_slice(&record[..n]);
    u64::from_le_bytes(key)
}

/// `--partitioner forward`: producer i feeds consumer i.
struct ToChannel(usize);

impl ChannelSelector<[u8]> for ToChannel {
    #[inline]
    fn select(&mut self, _record: &[u8], _channels: usize) -> Selection {
        Selection::Channel(self.0)
    }
}

/// One producer's emit loop with the selector the command line asked for. The choice is made
/// here, once per thread, and each arm is its own monomorphic loop, as a job's writer has one
/// selector type: a per-record `match` over the choices would be harness cost in the figures.
fn produce_one(
    args: &BenchArgs,
    index: usize,
    partition: ResultPartition,
    started: Instant,
) -> Result<OutputMetricsSnapshot, String> {
    let timeout = BufferTimeout::from_millis(args.buffer_timeout);
    match args.partitioner {
        Partitioner::RoundRobin => emit_for(
            args,
            RecordWriter::try_new(partition, RoundRobinSelector::starting_at(index), timeout)
                .map_err(|e| e.to_string())?,
            started,
        ),
        Partitioner::Hash => emit_for(
            args,
            RecordWriter::try_new(
                partition,
                KeyHashSelector::new(
                    record_key as fn(&[u8]) -> u64,
                    crate::topology::max_parallelism(args.consumers),
                ),
                timeout,
            )
            .map_err(|e| e.to_string())?,
            started,
        ),
        Partitioner::Broadcast => emit_for(
            args,
            RecordWriter::try_new(partition, BroadcastSelector, timeout)
                .map_err(|e| e.to_string())?,
            started,
        ),
        Partitioner::Forward => emit_for(
            args,
            RecordWriter::try_new(partition, ToChannel(index), timeout)
                .map_err(|e| e.to_string())?,
            started,
        ),
    }
}

/// Emits `--record-size` records through `writer` until `--duration` after `started`, then
/// finishes the partition; returns its final metrics.
fn emit_for<S: ChannelSelector<[u8]>>(
    args: &BenchArgs,
    mut writer: RecordWriter<S>,
    started: Instant,
) -> Result<OutputMetricsSnapshot, String> {
    let duration = Duration::from_secs_f64(args.duration);
    let size = args.record_size;
    let mut sequence = 0u64;
    // The clock is read every 64 KiB of records or so (at least every record): often enough
    // that large records do not run far past `--duration`, rarely enough to cost nothing.
    // Those records are one batch, written in place and emitted with one call.
    let per_look = (65_536 / size.max(1)).clamp(1, 1024);
    let mut batch = vec![0u8; size * per_look];
    while started.elapsed() < duration {
        if size == 0 || args.per_record {
            for _ in 0..per_look {
                if let Some(head) = batch.first_chunk_mut::<8>() {
                    *head = sequence.to_le_bytes();
                }
                sequence += 1;
                writer.emit(&batch[..size]).map_err(|e| e.to_string())?;
            }
            continue;
        }
        for record in batch.chunks_exact_mut(size) {
            // A fixed-size store when the record has room for the whole sequence number: no
            // `memcpy` call per record in the harness.
            if let Some(head) = record.first_chunk_mut::<8>() {
                *head = sequence.to_le_bytes();
            } else {
                let n = record.len();
                record.copy_from_slice(&sequence.to_le_bytes()[..n]);
            }
            sequence += 1;
        }
        writer
            .emit_all(batch.chunks_exact(size))
            .map_err(|e| e.to_string())?;
    }
    writer.finish().map_err(|e| e.to_string())?;
    Ok(writer.partition().metrics_snapshot())
}

/// Emits records from one thread per partition for `--duration` seconds, then finishes;
/// returns each partition's final metrics.
fn produce_throughput(
    args: &BenchArgs,
    partitions: Vec<ResultPartition>,
) -> Result<Vec<OutputMetricsSnapshot>, String> {
    let started = Instant::now();
    thread::scope(|scope| {
        let writers: Vec<_> = partitions
            .into_iter()
            .enumerate()
            .map(|(index, partition)| {
                scope.spawn(move || produce_one(args, index, partition, started))
            })
            .collect();
        writers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| Err("producer panicked".into())))
            .collect()
    })
}

/// Records read by the consumers of a throughput run, and their gates' final metrics.
struct Consumed {
    records: u64,
    bytes: u64,
    gates: Vec<InputMetricsSnapshot>,
}

fn consume_throughput(
    gates: Vec<SingleInputGate>,
    max_record: usize,
    per_record: bool,
) -> Result<Consumed, String> {
    let results: Vec<Result<(u64, u64, InputMetricsSnapshot), String>> = thread::scope(|scope| {
        let readers: Vec<_> = gates
            .into_iter()
            .map(|gate| {
                scope.spawn(move || {
                    let mut reader = RecordReader::new(gate, max_record);
                    let (mut records, mut bytes) = (0u64, 0u64);
                    loop {
                        match reader.next_timeout(Duration::from_secs(30)) {
                            Ok(Some(ReaderItem::Record { bytes: record, .. })) => {
                                records += 1;
                                bytes += record.len() as u64;
                                // The rest of the buffer's records in one batch.
                                if per_record {
                                    continue;
                                }
                                if let Some(batch) = reader.records_in_buffer() {
                                    for record in batch {
                                        records += 1;
                                        bytes += record.len() as u64;
                                    }
                                }
                            }
                            Ok(Some(ReaderItem::Event { .. })) => {}
                            Ok(None) => {
                                return Ok((records, bytes, reader.gate().metrics_snapshot()))
                            }
                            Err(error) => return Err(error.to_string()),
                        }
                    }
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|_| Err("consumer panicked".into())))
            .collect()
    });
    let mut consumed = Consumed {
        records: 0,
        bytes: 0,
        gates: Vec::new(),
    };
    for result in results {
        let (records, bytes, gate) = result?;
        consumed.records += records;
        consumed.bytes += bytes;
        consumed.gates.push(gate);
    }
    Ok(consumed)
}

fn throughput(
    args: &BenchArgs,
    config: &NetworkConfig,
) -> Result<(Figures, RunMetrics, Transport), String> {
    let exchange = Exchange::new(args, config, Phase::Throughput)?;
    // Local partitions exist before the gates ask for them (no retrigger back-off).
    let local_partitions = exchange.local_partitions(args.producers, args.consumers)?;
    let gates = (0..args.consumers)
        .map(|c| exchange.gate(c, args.producers))
        .collect::<Result<Vec<_>, _>>()?;
    let transport = exchange.transport();
    let Exchange {
        env,
        producer_process,
    } = exchange;
    let started = Instant::now();
    let cpu_started = cpu_time();
    let mut metrics = RunMetrics::default();
    let (consumed, producer_cpu, elapsed) = match producer_process {
        None => {
            let (produced, consumed) = thread::scope(|scope| {
                let producing = scope.spawn(|| produce_throughput(args, local_partitions));
                let consumed = consume_throughput(gates, config.max_record_bytes, args.per_record);
                let produced = producing
                    .join()
                    .unwrap_or_else(|_| Err("producer panicked".into()));
                (produced, consumed)
            });
            metrics.partitions = produced?;
            (consumed?, Duration::ZERO, started.elapsed())
        }
        Some(mut process) => {
            process.go()?;
            let consumed = consume_throughput(gates, config.max_record_bytes, args.per_record)?;
            // The run ends with the last record read; the producer's report and exit are not
            // part of it.
            let elapsed = started.elapsed();
            let report = process.finish()?;
            if !report.pool_full {
                return Err("segments were not returned to the producer process's pool".into());
            }
            metrics.partitions = report.partitions;
            (consumed, report.cpu, elapsed)
        }
    };
    let elapsed = elapsed.as_secs_f64();
    if !pool_full(&env) {
        return Err("segments were not returned to their pools".into());
    }
    let cpu = (cpu_time().saturating_sub(cpu_started) + producer_cpu).as_secs_f64();
    // A figure over records the engine lost (or made up) would be no figure: every record
    // written is read, once per consumer it was broadcast to.
    let written: u64 = metrics.partitions.iter().map(|p| p.num_records_out).sum();
    let copies = if args.partitioner == Partitioner::Broadcast {
        args.consumers as u64
    } else {
        1
    };
    if consumed.records != written * copies {
        return Err(format!(
            "the consumers read {} records where the producers wrote {written}{}: records were \
             lost or duplicated",
            consumed.records,
            if copies > 1 {
                format!(" to {copies} consumers each")
            } else {
                String::new()
            }
        ));
    }
    metrics.gates = consumed.gates;
    let records = consumed.records;
    let figures = Figures {
        records,
        records_per_sec: records as f64 / elapsed,
        payload_gb_per_sec: consumed.bytes as f64 / elapsed / 1e9,
        cpu_ns_per_record: cpu * 1e9 / records.max(1) as f64,
        ..Figures::default()
    };
    Ok((figures, metrics, transport))
}

/// Nanoseconds on `CLOCK_MONOTONIC`, the clock the baseline's `Instant` reads: both
/// processes of a remote latency run share it (they run on one machine), and unlike the wall
/// clock it never steps, so an NTP correction cannot shift the engine's samples and not the
/// baseline's.
fn monotonic_nanos() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// A latency histogram (ns) that grows past its first bound of a minute rather than clip:
/// a paced sender that falls behind for long measures from the scheduled send times, and its
/// samples grow without a bound; a clipped max would print too low, and on one side only.
pub(crate) fn latency_histogram() -> Result<Histogram<u64>, String> {
    let mut histogram =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| e.to_string())?;
    histogram.auto(true);
    Ok(histogram)
}

/// Records one latency sample (ns) in a [`latency_histogram`], growing it as needed
/// (`saturating_record` would clip even a growing histogram); 0 counts as 1 ns.
pub(crate) fn record_latency(histogram: &mut Histogram<u64>, nanos: u64) {
    let nanos = nanos.max(1);
    if histogram.record(nanos).is_err() {
        // Beyond what a u64 histogram can grow to: clipped there.
        histogram.saturating_record(nanos);
    }
}

/// The send time a latency run's warm-up record carries: it is not measured.
const WARM_UP: u64 = 0;

/// The latency run's producer: first one warm-up record, which the consumer reads before the
/// run starts (so connecting, the partition request and the first credit are not measured,
/// as the baseline connects before its clock starts); then, once `start` returns, one record
/// every 1/rate s, each carrying its *scheduled* send time, flushed at once
/// (`execution.buffer-timeout` = 0).
fn produce_latency(
    args: &BenchArgs,
    partition: ResultPartition,
    start: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let mut writer = RecordWriter::new(partition, ForwardSelector, BufferTimeout::Always);
    let mut record = vec![0u8; args.record_size.max(8)];
    record[..8].copy_from_slice(&WARM_UP.to_le_bytes());
    writer.emit(&record[..]).map_err(|e| e.to_string())?;
    start()?;
    let epoch = Instant::now();
    let epoch_nanos = monotonic_nanos();
    let total = (args.rate as f64 * args.latency_duration) as u64;
    for i in 0..total {
        let scheduled = scheduled(i, args.rate);
        pace(epoch, scheduled);
        let sent = epoch_nanos + scheduled.as_nanos() as u64;
        record[..8].copy_from_slice(&sent.to_le_bytes());
        writer.emit(&record[..]).map_err(|e| e.to_string())?;
    }
    writer.finish().map_err(|e| e.to_string())
}

/// The latency run's consumer: reads the warm-up record, calls `started` (a remote producer
/// is told to begin then), and records every later record's one-way latency.
fn consume_latency(
    gate: SingleInputGate,
    max_record: usize,
    started: impl FnOnce() -> Result<(), String>,
) -> Result<Histogram<u64>, String> {
    let mut histogram = latency_histogram()?;
    let mut reader = RecordReader::new(gate, max_record);
    match reader.next_timeout(Duration::from_secs(30)) {
        Ok(Some(ReaderItem::Record { bytes, .. }))
            if bytes.get(..8) == Some(&WARM_UP.to_le_bytes()[..]) => {}
        Ok(_) => return Err("the latency run did not begin with its warm-up record".into()),
        Err(error) => return Err(error.to_string()),
    }
    started()?;
    loop {
        match reader.next_timeout(Duration::from_secs(30)) {
            Ok(Some(ReaderItem::Record { bytes, .. })) => {
                let Some(sent) = bytes.get(..8) else {
                    return Err(format!("a {} B record in the latency run", bytes.len()));
                };
                let sent = u64::from_le_bytes(sent.try_into().expect("8 bytes"));
                record_latency(&mut histogram, monotonic_nanos().saturating_sub(sent));
            }
            Ok(Some(ReaderItem::Event { .. })) => {}
            Ok(None) => return Ok(histogram),
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// Fixed-rate 1 → 1 run: the one-way latency of every record.
fn latency(args: &BenchArgs, config: &NetworkConfig) -> Result<Histogram<u64>, String> {
    let histogram = latency_samples(args, config)?;
    // A lost record would be missing from the tail it belongs to, not counted as late.
    let sent = (args.rate as f64 * args.latency_duration) as u64;
    if histogram.len() != sent {
        return Err(format!(
            "the latency run's consumer read {} records of the {sent} sent: records were lost \
             or duplicated",
            histogram.len()
        ));
    }
    Ok(histogram)
}

/// [`latency`]'s run: the histogram of what the consumer read.
fn latency_samples(args: &BenchArgs, config: &NetworkConfig) -> Result<Histogram<u64>, String> {
    let exchange = Exchange::new(args, config, Phase::Latency)?;
    let local_partition = exchange.local_partitions(1, 1)?.pop();
    let gate = exchange.gate(0, 1)?;
    let histogram = match exchange.producer_process {
        Some(mut process) => {
            let histogram = consume_latency(gate, config.max_record_bytes, || process.go())?;
            if !process.finish()?.pool_full {
                return Err("segments were not returned to the producer process's pool".into());
            }
            histogram
        }
        None => {
            let partition = local_partition.ok_or("no local partition")?;
            // The producer starts its schedule once the consumer read the warm-up record, as
            // the producer process does on `go`.
            let (warmed_up, wait_warm_up) = std::sync::mpsc::sync_channel::<()>(1);
            let (produced, histogram) = thread::scope(|scope| {
                let producing = scope.spawn(move || {
                    produce_latency(args, partition, || {
                        wait_warm_up
                            .recv_timeout(PRODUCER_REPLY)
                            .map_err(|_| "the consumer did not read the warm-up record".to_string())
                    })
                });
                let histogram = consume_latency(gate, config.max_record_bytes, || {
                    warmed_up
                        .send(())
                        .map_err(|_| "the producer is gone".to_string())
                });
                let produced = producing
                    .join()
                    .unwrap_or_else(|_| Err("producer panicked".into()));
                (produced, histogram)
            });
            produced?;
            histogram?
        }
    };
    if !pool_full(&exchange.env) {
        return Err("segments were not returned to their pools".into());
    }
    Ok(histogram)
}

/// Waits until `scheduled` after `epoch`: sleeps while far ahead, yields when close, so the
/// other core stays free for the consumer.
pub(crate) fn pace(epoch: Instant, scheduled: Duration) {
    // Bounded by the schedule: each pass moves closer to it.
    loop {
        let now = epoch.elapsed();
        if now >= scheduled {
            return;
        }
        let ahead = scheduled - now;
        if ahead > Duration::from_micros(200) {
            thread::sleep(ahead - Duration::from_micros(100));
        } else {
            thread::yield_now();
        }
    }
}

fn print(
    args: &BenchArgs,
    config: &NetworkConfig,
    transport: Transport,
    engine: &Figures,
    baseline: Option<&Figures>,
    run_metrics: Option<&RunMetrics>,
) {
    let mode = if args.local {
        "local exchange (one process)".to_string()
    } else {
        let tls = if config.ssl_enabled { " with TLS" } else { "" };
        format!(
            "remote exchange between two processes over loopback TCP{tls} ({transport:?} driver)"
        )
    };
    // (name, unit, value of a figure set)
    type Metric = (&'static str, &'static str, fn(&Figures) -> Option<f64>);
    let metrics: [Metric; 8] = [
        ("records_per_sec", "records/s", |f| Some(f.records_per_sec)),
        ("payload_gb_per_sec", "GB/s", |f| Some(f.payload_gb_per_sec)),
        ("cpu_ns_per_record", "ns", |f| Some(f.cpu_ns_per_record)),
        ("latency_p50_us", "us", |f| f.latency_us.map(|l| l[0])),
        ("latency_p99_us", "us", |f| f.latency_us.map(|l| l[1])),
        ("latency_p999_us", "us", |f| f.latency_us.map(|l| l[2])),
        ("latency_max_us", "us", |f| f.latency_us.map(|l| l[3])),
        ("latency_samples", "records", |f| {
            f.latency_us.map(|_| f.latency_samples as f64)
        }),
    ];
    match args.format {
        Format::Table => {
            println!(
                "fluxgate bench: {mode}, {}→{} ({:?}), {} B records, {} B segments",
                args.producers,
                args.consumers,
                args.partitioner,
                args.record_size,
                config.segment_size
            );
            println!(
                "  throughput {:.1} s (buffer timeout {} ms); latency {} records/s for {:.1} s, flush every record",
                args.duration, args.buffer_timeout, args.rate, args.latency_duration
            );
            if !config.io_thread_busy_poll.is_zero() && !args.local {
                println!(
                    "  I/O threads busy-poll {} µs before they sleep (fluxgate.network.io-thread.busy-poll-us)",
                    config.io_thread_busy_poll.as_micros()
                );
            }
            if let Some(pinning) = args.pin_cpus {
                println!(
                    "  pinned: producer side (process, baseline writer) on CPU {}, consumer side on CPU {}",
                    pinning.producer, pinning.consumer
                );
            }
            // The baseline is one 1 → 1 stream in 32 KiB writes whatever the engine's shape: say
            // so where its ratios compare unlike work.
            let one_to_one = args.producers == 1
                && args.consumers == 1
                && args.partitioner != Partitioner::Broadcast;
            if baseline.is_some() && (!one_to_one || config.segment_size != 32 * 1024) {
                println!(
                    "  the raw-TCP baseline is one 1→1 stream in 32 KiB writes, not this {}→{} {:?} \
                     exchange of {} B segments: its ratios compare unlike work",
                    args.producers, args.consumers, args.partitioner, config.segment_size
                );
            }
            // The baseline never encrypts: say so beside an engine that does.
            let baseline_name = if config.ssl_enabled && !args.local {
                "raw TCP, no TLS"
            } else {
                "raw TCP"
            };
            // The ratio is fluxgate over the baseline: above 1 is better for records/s and GB/s,
            // worse for ns and µs.
            println!(
                "  {:<20} {:>14} {:>16} {:>13}",
                "figure", "fluxgate", baseline_name, "fluxgate/raw"
            );
            for (name, unit, get) in metrics {
                let Some(value) = get(engine) else { continue };
                // A count: whole, and no ratio.
                let count = unit == "records";
                let decimals = if count { 0 } else { 2 };
                let base = baseline.and_then(get);
                let base_text = base.map_or("-".to_string(), |b| format!("{b:.decimals$}"));
                let ratio = base
                    .filter(|b| *b > 0.0 && !count)
                    .map_or("-".to_string(), |b| format!("{:.2}", value / b));
                println!(
                    "  {:<20} {:>14.decimals$} {:>16} {:>13}   {unit}",
                    name, value, base_text, ratio
                );
            }
        }
        Format::Lines => {
            for (name, unit, get) in metrics {
                if let Some(value) = get(engine) {
                    println!("{name} {value:.3} {unit}");
                }
                if let Some(value) = baseline.and_then(get) {
                    println!("baseline_{name} {value:.3} {unit}");
                }
            }
        }
        Format::Json => {
            let mut fields = Vec::new();
            for (name, _, get) in metrics {
                if let Some(value) = get(engine) {
                    fields.push(format!("\"{name}\":{value:.3}"));
                }
                if let Some(value) = baseline.and_then(get) {
                    fields.push(format!("\"baseline_{name}\":{value:.3}"));
                }
            }
            if let Some(run_metrics) = run_metrics {
                fields.push(format!("\"metrics\":{}", metrics_json(run_metrics)));
            }
            println!("{{\"records\":{},{}}}", engine.records, fields.join(","));
            return;
        }
    }
    if let Some(run_metrics) = run_metrics {
        print_metrics(args.format, run_metrics);
    }
}

/// `{"partitions": [...], "gates": [...]}` with Flink's names.
fn metrics_json(metrics: &RunMetrics) -> serde_json::Value {
    serde_json::json!({
        "partitions": metrics.partitions,
        "gates": metrics.gates,
    })
}

/// The unit of a metric in `--format lines`, from its Flink name.
fn metric_unit(name: &str) -> &'static str {
    if name.starts_with("numRecords") {
        "records"
    } else if name.starts_with("numBytes") {
        "bytes"
    } else if name.starts_with("numBuffers") {
        "buffers"
    } else if name.ends_with("Usage") {
        "ratio"
    } else if name.ends_with("QueueLength") {
        "items"
    } else {
        "ms"
    }
}

/// `--metrics`: the final snapshots of the throughput run's partitions and gates.
fn print_metrics(format: Format, metrics: &RunMetrics) {
    match format {
        Format::Table => {
            println!("  metrics of the throughput run (Flink's names)");
            for (index, snapshot) in metrics.partitions.iter().enumerate() {
                println!("  partition {index:<3} {snapshot}");
            }
            for (index, snapshot) in metrics.gates.iter().enumerate() {
                println!("  gate {index:<8} {snapshot}");
            }
        }
        Format::Lines => {
            let partitions = metrics
                .partitions
                .iter()
                .enumerate()
                .flat_map(|(i, s)| s.fields().map(|f| ("partition", i, f)));
            let gates = metrics
                .gates
                .iter()
                .enumerate()
                .flat_map(|(i, s)| s.fields().map(|f| ("gate", i, f)));
            for (scope, index, (name, value)) in partitions.chain(gates) {
                println!("{scope}.{index}.{name} {value} {}", metric_unit(name));
            }
        }
        Format::Json => println!("{}", metrics_json(metrics)),
    }
}

/// CPU time of the whole process (all its threads, those ended too), to the nanosecond
/// (`CLOCK_PROCESS_CPUTIME_ID`; `/proc/self/stat` counts in 10 ms ticks, 1-2 % of a one-second
/// run).
fn cpu_time() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(
        now.tv_sec.max(0) as u64,
        now.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latency_beyond_a_minute_is_reported_as_it_was() {
        let mut histogram = latency_histogram().unwrap();
        let two_minutes = 120_000_000_000;
        record_latency(&mut histogram, two_minutes);
        // hdrhistogram reports a value's bucket; at 3 significant digits that is within 0.1 %.
        let max = histogram.max();
        assert!(
            max.abs_diff(two_minutes) <= two_minutes / 1000,
            "a two-minute sample reported as {max} ns"
        );
    }
}
