//! `fluxgate bench`: until the exchange exists, the segment + record path between two threads:
//! a producer serializes records straight into pooled segments, a consumer deserializes them
//! and drops the buffers, which recycles the segments to the producer's pool.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fluxgate::buffer::NetworkBufferPool;
use fluxgate::buffer::{Buffer, BufferBuilder, BufferConsumer, LocalBufferPool, LocalPoolSpec};
use fluxgate::record::{self, RecordDeserializer, RecordError, SegmentSink};
use fluxgate::NetworkConfig;

/// Options of `fluxgate bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Bytes per record.
    #[arg(long, default_value_t = 8)]
    record_size: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// `taskmanager.memory.segment-size` in bytes.
    #[arg(long, default_value_t = 32 * 1024)]
    segment_size: usize,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// A readable table.
    Table,
    /// One `name value unit` line per figure.
    Lines,
}

/// Builders filled by the producer, handed to the consumer thread as finished buffers.
struct ChannelSink<'a> {
    pool: &'a LocalBufferPool,
    current: Option<(BufferBuilder, BufferConsumer)>,
    out: &'a mpsc::SyncSender<Buffer>,
    timeout: Duration,
}

impl ChannelSink<'_> {
    fn ship(&mut self) {
        if let Some((mut builder, mut consumer)) = self.current.take() {
            builder.finish();
            let buffer = consumer.build();
            drop((builder, consumer));
            // The consumer only goes away at the end of the run.
            let _ = self.out.send(buffer);
        }
    }
}

impl SegmentSink for ChannelSink<'_> {
    fn writable(&mut self) -> Result<&mut BufferBuilder, RecordError> {
        if self.current.as_ref().is_some_and(|(b, _)| b.is_full()) {
            self.ship();
        }
        if self.current.is_none() {
            let builder = self.pool.request_buffer_builder_blocking(0, self.timeout)?;
            let consumer = builder.create_consumer_from_beginning();
            self.current = Some((builder, consumer));
        }
        Ok(&mut self.current.as_mut().expect("just set").0)
    }

    fn commit(&mut self) {
        if let Some((builder, _)) = self.current.as_mut() {
            builder.commit();
        }
    }
}

/// Runs the benchmark and prints its figures.
pub fn run(args: &BenchArgs) -> Result<(), String> {
    let mut config = NetworkConfig::default();
    config
        .set(
            "taskmanager.memory.segment-size",
            &args.segment_size.to_string(),
        )
        .map_err(|e| e.to_string())?;
    let network = NetworkBufferPool::new(&config).map_err(|e| e.to_string())?;
    let pool = network
        .create_local_pool(LocalPoolSpec::for_partition(1, &config))
        .map_err(|e| e.to_string())?;
    let record = vec![0xA5u8; args.record_size];
    let duration = Duration::from_secs_f64(args.duration);
    let (tx, rx) = mpsc::sync_channel::<Buffer>(config.max_buffers_per_channel);

    let started = Instant::now();
    let cpu_started = cpu_time();
    let (produced, consumed) = thread::scope(|scope| {
        let consumer = scope.spawn(move || {
            let mut deserializer = RecordDeserializer::new(config.max_record_bytes);
            let mut records = 0u64;
            while let Ok(buffer) = rx.recv() {
                deserializer
                    .set_next_buffer(buffer)
                    .expect("read to the end");
                while let Some(record) = deserializer.next_record().expect("valid stream") {
                    std::hint::black_box(record);
                    records += 1;
                }
            }
            records
        });
        let mut sink = ChannelSink {
            pool: &pool,
            current: None,
            out: &tx,
            timeout: config.buffer_request_timeout,
        };
        let mut produced = 0u64;
        while started.elapsed() < duration {
            for _ in 0..4096 {
                record::serialize(&record[..], &mut sink, config.max_record_bytes)
                    .expect("pool alive");
            }
            produced += 4096;
        }
        sink.ship();
        drop(tx);
        (produced, consumer.join().expect("consumer thread"))
    });
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_time().saturating_sub(cpu_started).as_secs_f64();
    if produced != consumed {
        return Err(format!(
            "lost records: produced {produced}, consumed {consumed}"
        ));
    }
    let records_per_sec = consumed as f64 / elapsed;
    let payload_gb = consumed as f64 * args.record_size as f64 / elapsed / 1e9;
    let cpu_ns = cpu * 1e9 / consumed as f64;
    match args.format {
        Format::Table => {
            println!("fluxgate bench (segment + record path, two threads, no network yet)");
            println!("  record size        {:>12} B", args.record_size);
            println!("  records            {consumed:>12}");
            println!("  records/s          {records_per_sec:>12.0}");
            println!("  payload            {payload_gb:>12.3} GB/s");
            println!("  CPU per record     {cpu_ns:>12.1} ns");
        }
        Format::Lines => {
            println!("records_per_sec {records_per_sec:.0} records/s");
            println!("payload_gb_per_sec {payload_gb:.3} GB/s");
            println!("cpu_ns_per_record {cpu_ns:.1} ns");
        }
    }
    Ok(())
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
