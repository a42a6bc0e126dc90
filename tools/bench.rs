//! `fluxgate bench`: throughput and latency of an exchange.
//!
//! Until the network transport lands, the exchange is local: producer threads write through
//! `RecordWriter`s into result partitions, consumer threads read through `RecordReader`s over
//! input gates whose local channels take the producers' buffers by reference.
//!
//! * Throughput run: P producers × C consumers emit records as fast as they can for the
//!   duration; reported as records/s, payload GB/s and process CPU ns per record.
//! * Latency run: one producer, one consumer, records sent at a fixed rate with a flush after
//!   every record (`execution.buffer-timeout` = 0). Each record carries its *scheduled* send
//!   time, so a stalled sender shows up in the histogram (no coordinated omission).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fluxgate::config::ConfigError;
use fluxgate::gate::{ConsumedSubpartition, ReaderItem, RecordReader, SingleInputGate};
use fluxgate::io::Transport;
use fluxgate::metrics::{InputMetricsSnapshot, OutputMetricsSnapshot};
use fluxgate::partition::{
    BroadcastSelector, BufferTimeout, ChannelSelector, ForwardSelector, KeyHashSelector,
    RecordWriter, ResultPartition, ResultPartitionId, RoundRobinSelector, Selection,
};
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

use crate::baseline;
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
    /// Seconds of the throughput run.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Records per second of the latency run (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    rate: u64,
    /// Seconds of the latency run.
    #[arg(long, default_value_t = 2.0)]
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
    if !from_file.contains("taskmanager.memory.network.max") {
        // Room for every partition's and gate's pool.
        let pools =
            args.producers * (args.consumers * 2 + 8) + args.consumers * (args.producers * 2 + 9);
        let memory = (pools * config.segment_size * 2).max(64 << 20);
        config
            .set("taskmanager.memory.network.max", &memory.to_string())
            .map_err(|e| e.to_string())?;
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
    let (mut engine, metrics) = throughput(args, &config)?;
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
    print(args, &config, &engine, baseline.as_ref(), metrics);
    Ok(())
}

/// Applies a TOML file of Flink option names to `config`; returns the names it set. Nested
/// tables join their keys with dots, so `taskmanager.memory.segment-size = "16kb"` (a dotted
/// key) and the quoted `"taskmanager.memory.segment-size" = "16kb"` mean the same.
fn apply_config_file(path: &Path, config: &mut NetworkConfig) -> Result<BTreeSet<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read config file `{}`: {e}", path.display()))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        format!(
            "config file `{}`: {}",
            path.display(),
            e.to_string().trim_end()
        )
    })?;
    let mut options = Vec::new();
    flatten("", &table, &mut options);
    let mut set = BTreeSet::new();
    for (key, value) in options {
        let text = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            other => {
                return Err(format!(
                    "config file `{}`: `{key}`: expected a string or an integer, got {}",
                    path.display(),
                    other.type_str()
                ))
            }
        };
        config.set(&key, &text).map_err(|e| match e {
            ConfigError::UnknownOption(_) => format!(
                "config file `{}`: {e} (known options: {})",
                path.display(),
                NetworkConfig::OPTIONS.join(", ")
            ),
            _ => format!("config file `{}`: {e}", path.display()),
        })?;
        set.insert(key);
    }
    Ok(set)
}

/// The leaves of `table` as (dotted key, value).
fn flatten<'a>(prefix: &str, table: &'a toml::Table, out: &mut Vec<(String, &'a toml::Value)>) {
    for (key, value) in table {
        let key = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            toml::Value::Table(inner) => flatten(&key, inner, out),
            leaf => out.push((key, leaf)),
        }
    }
}

fn baseline_figures(
    args: &BenchArgs,
    progress: &Progress,
) -> Result<(Figures, Option<Histogram<u64>>), String> {
    progress.phase("baseline throughput");
    let cpu_started = cpu_time();
    let moved = baseline::throughput(args.record_size, Duration::from_secs_f64(args.duration))
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

/// One exchange: producers in one shuffle environment, consumers in another one reached over
/// loopback TCP (remote), or in the same one through local channels (`--local`).
struct Exchange {
    producers: ShuffleEnvironment,
    consumers: Option<ShuffleEnvironment>,
}

impl Exchange {
    fn new(args: &BenchArgs, config: &NetworkConfig) -> Result<Self, String> {
        let start = |node| {
            ShuffleEnvironment::start(EnvConfig {
                network: config.clone(),
                transport: args.transport,
                node,
                ..EnvConfig::default()
            })
            .map_err(|e| e.to_string())
        };
        let producers = start(1)?;
        let consumers = if args.local { None } else { Some(start(2)?) };
        Ok(Self {
            producers,
            consumers,
        })
    }

    fn partition(&self, producer: usize, consumers: usize) -> Result<ResultPartition, String> {
        let id = ResultPartitionId {
            partition: producer as u64,
            producer: 0,
        };
        self.producers
            .create_partition(id, consumers)
            .map_err(|e| e.to_string())
    }

    fn gate(&self, consumer: usize, producers: usize) -> Result<SingleInputGate, String> {
        let (env, location) = match &self.consumers {
            Some(env) => (env, ProducerLocation::Remote(self.producers.local_addr())),
            None => (&self.producers, ProducerLocation::Local),
        };
        let channels: Vec<_> = (0..producers)
            .map(|producer| ChannelDescriptor {
                consumed: ConsumedSubpartition {
                    partition: ResultPartitionId {
                        partition: producer as u64,
                        producer: 0,
                    },
                    subpartition: consumer,
                },
                location: location.clone(),
            })
            .collect();
        env.create_gate(&channels).map_err(|e| e.to_string())
    }

    /// True once every segment of both environments is back in its pool.
    fn pools_full(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let full = |env: &ShuffleEnvironment| {
            env.network().available_segments() == env.network().total_segments()
        };
        // Bounded: segments on their way back arrive within the deadline or it is a leak.
        while Instant::now() < deadline {
            if full(&self.producers) && self.consumers.as_ref().is_none_or(full) {
                return true;
            }
            thread::sleep(Duration::from_millis(1));
        }
        false
    }
}

/// The selector the command line asked for, over byte records.
enum AnySelector {
    RoundRobin(RoundRobinSelector),
    Hash(KeyHashSelector<fn(&[u8]) -> u64>),
    Broadcast(BroadcastSelector),
    /// Producer i feeds consumer i.
    Forward(usize),
}

fn record_key(record: &[u8]) -> u64 {
    let mut key = [0u8; 8];
    let n = record.len().min(8);
    key[..n].copy_from_slice(&record[..n]);
    u64::from_le_bytes(key)
}

impl ChannelSelector<[u8]> for AnySelector {
    #[inline]
    fn select(&mut self, record: &[u8], channels: usize) -> Selection {
        match self {
            AnySelector::RoundRobin(s) => s.select(record, channels),
            AnySelector::Hash(s) => s.select(record, channels),
            AnySelector::Broadcast(s) => ChannelSelector::<[u8]>::select(s, record, channels),
            AnySelector::Forward(own) => Selection::Channel(*own),
        }
    }
}

fn selector(partitioner: Partitioner, producer: usize) -> AnySelector {
    match partitioner {
        Partitioner::RoundRobin => {
            AnySelector::RoundRobin(RoundRobinSelector::starting_at(producer))
        }
        Partitioner::Hash => {
            AnySelector::Hash(KeyHashSelector::new(record_key as fn(&[u8]) -> u64, 128))
        }
        Partitioner::Broadcast => AnySelector::Broadcast(BroadcastSelector),
        Partitioner::Forward => AnySelector::Forward(producer),
    }
}

fn throughput(args: &BenchArgs, config: &NetworkConfig) -> Result<(Figures, RunMetrics), String> {
    let exchange = Exchange::new(args, config)?;
    let partitions = (0..args.producers)
        .map(|p| exchange.partition(p, args.consumers))
        .collect::<Result<Vec<_>, _>>()?;
    let gates = (0..args.consumers)
        .map(|c| exchange.gate(c, args.producers))
        .collect::<Result<Vec<_>, _>>()?;
    let duration = Duration::from_secs_f64(args.duration);
    let timeout = BufferTimeout::from_millis(args.buffer_timeout);
    let started = Instant::now();
    let cpu_started = cpu_time();
    let mut metrics = RunMetrics::default();
    let consumed: Vec<Result<(u64, u64, InputMetricsSnapshot), String>> = thread::scope(|scope| {
        let mut writers = Vec::with_capacity(partitions.len());
        for (index, partition) in partitions.into_iter().enumerate() {
            let partitioner = args.partitioner;
            let record_size = args.record_size;
            writers.push(scope.spawn(move || {
                let mut writer =
                    RecordWriter::new(partition, selector(partitioner, index), timeout);
                let mut record = vec![0u8; record_size];
                let mut sequence = 0u64;
                while started.elapsed() < duration {
                    for _ in 0..1024 {
                        let n = record.len().min(8);
                        record[..n].copy_from_slice(&sequence.to_le_bytes()[..n]);
                        writer.emit(&record[..]).expect("local exchange alive");
                        sequence += 1;
                    }
                }
                writer.finish().expect("local exchange alive");
                // Kept until the consumers are done, for the final snapshot.
                writer
            }));
        }
        let readers: Vec<_> = gates
            .into_iter()
            .map(|gate| {
                let max = config.max_record_bytes;
                scope.spawn(move || {
                    let mut reader = RecordReader::new(gate, max);
                    let (mut records, mut bytes) = (0u64, 0u64);
                    loop {
                        match reader.next_timeout(Duration::from_secs(30)) {
                            Ok(Some(ReaderItem::Record { bytes: record, .. })) => {
                                records += 1;
                                bytes += record.len() as u64;
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
        let mut consumed: Vec<_> = readers
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|_| Err("consumer panicked".into())))
            .collect();
        for writer in writers {
            match writer.join() {
                Ok(writer) => metrics
                    .partitions
                    .push(writer.partition().metrics_snapshot()),
                Err(_) => consumed.push(Err("producer panicked".into())),
            }
        }
        consumed
    });
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_time().saturating_sub(cpu_started).as_secs_f64();
    let mut records = 0;
    let mut bytes = 0;
    for result in consumed {
        let (r, b, gate) = result?;
        records += r;
        bytes += b;
        metrics.gates.push(gate);
    }
    if !exchange.pools_full() {
        return Err("segments were not returned to their pools".into());
    }
    let figures = Figures {
        records,
        records_per_sec: records as f64 / elapsed,
        payload_gb_per_sec: bytes as f64 / elapsed / 1e9,
        cpu_ns_per_record: cpu * 1e9 / records.max(1) as f64,
        ..Figures::default()
    };
    Ok((figures, metrics))
}

/// Fixed-rate 1 → 1 run; returns p50, p99, p99.9 and max in µs, and the sample count.
fn latency(args: &BenchArgs, config: &NetworkConfig) -> Result<Histogram<u64>, String> {
    let exchange = Exchange::new(args, config)?;
    let partition = exchange.partition(0, 1)?;
    let gate = exchange.gate(0, 1)?;
    let epoch = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / args.rate as f64);
    let total = (args.rate as f64 * args.latency_duration) as u64;
    let size = args.record_size.max(8);
    let histogram = thread::scope(|scope| {
        scope.spawn(move || {
            let mut writer = RecordWriter::new(partition, ForwardSelector, BufferTimeout::Always);
            let mut record = vec![0u8; size];
            for i in 0..total {
                let scheduled = interval * i as u32;
                pace(epoch, scheduled);
                record[..8].copy_from_slice(&(scheduled.as_nanos() as u64).to_le_bytes());
                writer.emit(&record[..]).expect("local exchange alive");
            }
            writer.finish().expect("local exchange alive");
        });
        let reader = scope.spawn(move || -> Result<Histogram<u64>, String> {
            let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
                .map_err(|e| e.to_string())?;
            let mut reader = RecordReader::new(gate, config.max_record_bytes);
            loop {
                match reader.next_timeout(Duration::from_secs(30)) {
                    Ok(Some(ReaderItem::Record { bytes, .. })) => {
                        let sent = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
                        let now = epoch.elapsed().as_nanos() as u64;
                        histogram.saturating_record(now.saturating_sub(sent).max(1));
                    }
                    Ok(Some(ReaderItem::Event { .. })) => {}
                    Ok(None) => return Ok(histogram),
                    Err(error) => return Err(error.to_string()),
                }
            }
        });
        reader
            .join()
            .unwrap_or_else(|_| Err("consumer panicked".into()))
    })?;
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
    engine: &Figures,
    baseline: Option<&Figures>,
    run_metrics: Option<&RunMetrics>,
) {
    let mode = if args.local {
        "local exchange (one process)".to_string()
    } else {
        format!(
            "remote exchange over loopback TCP ({:?} driver)",
            args.transport
        )
    };
    // (name, unit, value of a figure set, lower is better)
    type Metric = (&'static str, &'static str, fn(&Figures) -> Option<f64>);
    let metrics: [Metric; 7] = [
        ("records_per_sec", "records/s", |f| Some(f.records_per_sec)),
        ("payload_gb_per_sec", "GB/s", |f| Some(f.payload_gb_per_sec)),
        ("cpu_ns_per_record", "ns", |f| Some(f.cpu_ns_per_record)),
        ("latency_p50_us", "us", |f| f.latency_us.map(|l| l[0])),
        ("latency_p99_us", "us", |f| f.latency_us.map(|l| l[1])),
        ("latency_p999_us", "us", |f| f.latency_us.map(|l| l[2])),
        ("latency_max_us", "us", |f| f.latency_us.map(|l| l[3])),
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
            println!(
                "  {:<20} {:>14} {:>14} {:>8}",
                "figure", "fluxgate", "raw TCP", "ratio"
            );
            for (name, unit, get) in metrics {
                let Some(value) = get(engine) else { continue };
                let base = baseline.and_then(get);
                let base_text = base.map_or("-".to_string(), |b| format!("{b:.2}"));
                let ratio = base
                    .filter(|b| *b > 0.0)
                    .map_or("-".to_string(), |b| format!("{:.2}", value / b));
                println!(
                    "  {:<20} {:>14.2} {:>14} {:>8}   {unit}",
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
    } else if name.ends_with("PoolUsage") {
        "ratio"
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

/// CPU time of the whole process (all threads), from `/proc/self/stat` (std has no process
/// CPU clock, and this keeps the tool free of `unsafe`). Zero if unreadable.
fn cpu_time() -> Duration {
    // USER_HZ, the unit of utime/stime, is 100 on every Linux target we run on.
    const TICKS_PER_SEC: u64 = 100;
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
            let (_, rest) = stat.rsplit_once(')')?;
            let mut fields = rest.split_whitespace().skip(11);
            let utime: u64 = fields.next()?.parse().ok()?;
            let stime: u64 = fields.next()?.parse().ok()?;
            Some(utime + stime)
        })
        .unwrap_or(0);
    Duration::from_millis(ticks * 1000 / TICKS_PER_SEC)
}
