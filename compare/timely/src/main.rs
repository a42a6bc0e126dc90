//! The record stream of `fluxgate bench`'s throughput run, moved between two processes by
//! timely-dataflow's communication layer (`timely_communication`, the TCP allocator that
//! timely and Materialize use), so that the engine's CPU per record can be put beside a
//! production Rust peer's on the same machine.
//!
//! What each side does, kept as close to `fluxgate bench` as timely allows:
//! - Process 0's worker packs records (`[LEB128 length | bytes]`, the engine's record framing)
//!   back to back into a batch of at most `--batch-bytes` (32 KiB, the engine's segment) and
//!   pushes the batch to process 1's worker. Timely serializes it into its send slab and its
//!   send thread writes it to the one TCP connection between the processes.
//! - Process 1's receive thread reads the connection into its slab; the worker pulls each
//!   batch as a zero-copy slice of that slab and walks its records, counting them.
//! - Timely has no flow control, so the comparison adds the engine's: the receiver returns
//!   one credit per batch it has read (sent together at the end of each of its passes, as the
//!   engine's consumer announces credit) and the sender keeps at most `--window` batches
//!   unacknowledged (10, the engine's default credit: 2 exclusive + 8 floating buffers).
//!   Without it the sender's queue grows without bound and allocation dominates.
//! - Waiting is timely's own: a worker with nothing to do parks in `await_events` until a
//!   communication thread unparks it.
//!
//! CPU is user + system time of both processes (all their threads, read from `/proc/self/stat`
//! by each at its end) over the records received: the figure `fluxgate bench` prints as
//! `cpu_ns_per_record`.
//!
//! With `--rate R` it runs `fluxgate bench`'s latency run instead: a warm-up record answered
//! before the clock starts, then one record every 1/R s, paced as the bench paces (sleep when
//! far ahead, yield when close), each carrying its scheduled send time, each its own message
//! published at once (the engine's flush after every record); the receiver records each
//! record's one-way latency and prints p50, p99, p99.9 and max.
//!
//! Run: `cargo run --release -- --record-size 8` (or 1024), or `-- --rate 10000`; `--help`
//! for the options.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use timely_bytes::arc::Bytes;
use timely_communication::{Allocator, Bytesable, Config, Pull, Push};

/// Channel 0 carries batches of records from worker 0 to worker 1.
const DATA: usize = 0;
/// Channel 1 carries credit (batches read) from worker 1 back to worker 0.
const CREDIT: usize = 1;
/// Channel 2 carries the sender's total, once, after its last batch.
const END: usize = 2;

#[derive(Clone, Debug)]
struct Options {
    record_size: usize,
    duration: Duration,
    window: u64,
    batch_bytes: usize,
    port: u16,
    process: Option<usize>,
    /// Records per second of a latency run; 0 runs the throughput run.
    rate: u64,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut options = Options {
            record_size: 8,
            duration: Duration::from_secs(3),
            window: 10,
            batch_bytes: 32 * 1024 - 64,
            port: 0,
            process: None,
            rate: 0,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(USAGE.to_string());
            }
            let value = args
                .next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
            let number = |what: &str| -> Result<u64, String> {
                value
                    .parse::<u64>()
                    .map_err(|e| format!("{what} {value}: {e}"))
            };
            match flag.as_str() {
                "--record-size" => options.record_size = number("--record-size")? as usize,
                "--duration" => {
                    options.duration = Duration::try_from_secs_f64(
                        value
                            .parse::<f64>()
                            .map_err(|e| format!("--duration: {e}"))?,
                    )
                    .map_err(|e| format!("--duration: {e}"))?
                }
                "--window" => options.window = number("--window")?.max(1),
                "--batch-bytes" => options.batch_bytes = number("--batch-bytes")? as usize,
                "--port" => {
                    // The second process listens on the next port.
                    options.port = u16::try_from(number("--port")?)
                        .ok()
                        .filter(|&port| port < u16::MAX)
                        .ok_or("--port must be 1 ..= 65534")?
                }
                "--process" => options.process = Some(number("--process")? as usize),
                "--rate" => options.rate = number("--rate")?,
                _ => return Err(format!("unknown option {flag}\n{USAGE}")),
            }
        }
        if options.record_size == 0 || options.record_size > u32::MAX as usize {
            return Err("--record-size must be 1 ..= 4 GiB".into());
        }
        if options.rate > 0 && options.record_size < 8 {
            return Err("a latency run (--rate) needs records of at least 8 bytes".into());
        }
        Ok(options)
    }

    fn addresses(&self) -> Vec<String> {
        vec![
            format!("127.0.0.1:{}", self.port),
            format!("127.0.0.1:{}", self.port + 1),
        ]
    }
}

const USAGE: &str = "usage: timely-exchange [--record-size BYTES (8)] [--duration SECONDS (3)] \
[--window BATCHES (10)] [--batch-bytes BYTES (32704)] [--port FIRST_OF_TWO (a free pair)] \
[--rate RECORDS_PER_SEC (0: the throughput run)]";

/// A batch of framed records: owned on the sending side (its buffer reused batch after
/// batch), a slice of timely's receive slab on the receiving side.
enum Batch {
    Owned(Vec<u8>),
    Received(Bytes),
}

impl Batch {
    fn bytes(&self) -> &[u8] {
        match self {
            Batch::Owned(bytes) => bytes,
            Batch::Received(bytes) => bytes,
        }
    }
}

impl Bytesable for Batch {
    fn from_bytes(bytes: Bytes) -> Self {
        Batch::Received(bytes)
    }

    fn length_in_bytes(&self) -> usize {
        self.bytes().len()
    }

    fn into_bytes<W: std::io::Write>(&self, writer: &mut W) {
        writer
            .write_all(self.bytes())
            .expect("timely reserved room for the whole batch");
    }
}

fn put_length(out: &mut Vec<u8>, mut len: usize) {
    while len >= 0x80 {
        out.push((len as u8) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
}

/// The LEB128 length at the start of `bytes` and how many bytes it took.
fn length_of(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut len = 0usize;
    for (i, &byte) in bytes.iter().enumerate().take(5) {
        len |= usize::from(byte & 0x7F) << (7 * i);
        if byte < 0x80 {
            return Some((len, i + 1));
        }
    }
    None
}

/// Calls `on_record` with each record of one batch; an error when the batch does not end on a
/// record boundary (the sender never splits a record) or `on_record` fails.
fn for_each_record(
    mut bytes: &[u8],
    on_record: &mut impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<u64, String> {
    let mut records = 0;
    // Bounded by the batch: each pass takes one record.
    while !bytes.is_empty() {
        let (len, used) = length_of(bytes).ok_or("a malformed record length")?;
        let record = bytes
            .get(used..used + len)
            .ok_or("a batch split a record")?;
        on_record(record)?;
        records += 1;
        bytes = &bytes[used + len..];
    }
    Ok(records)
}

fn u64_batch(value: u64) -> Batch {
    Batch::Owned(value.to_le_bytes().to_vec())
}

fn u64_of(batch: &Batch) -> Result<u64, String> {
    let bytes: [u8; 8] = batch
        .bytes()
        .try_into()
        .map_err(|_| format!("an {} B control message", batch.bytes().len()))?;
    Ok(u64::from_le_bytes(bytes))
}

/// Surfaces received messages and drains the channel events, as timely's worker does each
/// step: `await_events` parks only while that queue is empty.
fn receive_events(allocator: &mut Allocator) {
    allocator.receive();
    allocator.events().borrow_mut().clear();
}

/// The sending worker's ends of the three channels and its count of batches the receiver
/// has not yet acknowledged.
struct Sender {
    data: Vec<Box<dyn Push<Batch>>>,
    credit: Box<dyn Pull<Batch>>,
    end: Vec<Box<dyn Push<Batch>>>,
    unacknowledged: u64,
    /// The batch buffer, reused message after message.
    buffer: Vec<u8>,
}

impl Sender {
    fn new(allocator: &mut Allocator) -> Self {
        let (data, _) = allocator.allocate::<Batch>(DATA);
        let (_, credit) = allocator.allocate::<Batch>(CREDIT);
        let (end, _) = allocator.allocate::<Batch>(END);
        Self {
            data,
            credit,
            end,
            unacknowledged: 0,
            buffer: Vec::new(),
        }
    }

    /// Takes the credit that arrived.
    fn take_credit(&mut self, allocator: &mut Allocator) -> Result<(), String> {
        receive_events(allocator);
        while let Some(batch) = self.credit.recv() {
            self.unacknowledged = self.unacknowledged.saturating_sub(u64_of(&batch)?);
        }
        Ok(())
    }

    /// Waits until fewer than `limit` batches are unacknowledged; an error after `patience`.
    fn wait_below(
        &mut self,
        allocator: &mut Allocator,
        limit: u64,
        patience: Duration,
    ) -> Result<(), String> {
        let started = Instant::now();
        self.take_credit(allocator)?;
        // Bounded by `patience`.
        while self.unacknowledged >= limit {
            if started.elapsed() > patience {
                return Err(format!("no credit for {patience:?}"));
            }
            allocator.await_events(Some(Duration::from_millis(10)));
            self.take_credit(allocator)?;
        }
        Ok(())
    }

    /// Pushes `buffer`'s bytes to the receiver as one batch and publishes it.
    fn push_buffer(&mut self, allocator: &mut Allocator) {
        let mut slot = Some(Batch::Owned(std::mem::take(&mut self.buffer)));
        self.data[1].push(&mut slot);
        if let Some(Batch::Owned(buffer)) = slot {
            self.buffer = buffer;
        }
        self.unacknowledged += 1;
        allocator.release();
    }

    /// Tells the receiver how many records to expect and closes the channels.
    fn finish(mut self, allocator: &mut Allocator, records: u64) -> String {
        self.end[1].send(u64_batch(records));
        self.end[1].done();
        self.data[1].done();
        allocator.release();
        format!("sent {records}")
    }
}

/// A worker's patience with a silent peer.
const PATIENCE: Duration = Duration::from_secs(30);

/// Worker 0: batches of records for `duration`, at most `window` unacknowledged.
fn send(mut allocator: Allocator, options: &Options) -> Result<String, String> {
    let mut sender = Sender::new(&mut allocator);
    let mut framed = Vec::with_capacity(options.record_size + 5);
    put_length(&mut framed, options.record_size);
    framed.resize(framed.len() + options.record_size, 0xA5);
    sender.buffer.reserve(options.batch_bytes.max(framed.len()));
    let mut records = 0u64;
    let started = Instant::now();
    while started.elapsed() < options.duration {
        sender.wait_below(&mut allocator, options.window, PATIENCE)?;
        // At least one record per batch, so records larger than a batch are sent too.
        sender.buffer.clear();
        loop {
            sender.buffer.extend_from_slice(&framed);
            records += 1;
            if sender.buffer.len() + framed.len() > options.batch_bytes {
                break;
            }
        }
        sender.push_buffer(&mut allocator);
    }
    Ok(sender.finish(&mut allocator, records))
}

/// What a receiving worker saw: the records, and when the first and last batch were read.
struct Received {
    records: u64,
    /// The start of the pass that read the first batch (whose records count).
    first: Option<Instant>,
    last: Instant,
}

/// Worker 1's loop, both runs: reads batches until it has the sender's total, calling
/// `on_record` for each record and returning one credit per batch read, sent once per pass.
fn receive_all(
    allocator: &mut Allocator,
    mut on_record: impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<Received, String> {
    let (_, mut data) = allocator.allocate::<Batch>(DATA);
    let (mut credit, _) = allocator.allocate::<Batch>(CREDIT);
    let (_, mut end) = allocator.allocate::<Batch>(END);
    let mut received = Received {
        records: 0,
        first: None,
        last: Instant::now(),
    };
    let mut expected = None;
    // Bounded: the sender's run is bounded, and a silent peer ends the wait below.
    let mut idle_since = Instant::now();
    loop {
        let pass_started = Instant::now();
        receive_events(allocator);
        let mut read = 0u64;
        while let Some(batch) = data.recv() {
            received.records += for_each_record(batch.bytes(), &mut on_record)?;
            read += 1;
        }
        if read > 0 {
            received.last = Instant::now();
            received.first.get_or_insert(pass_started);
            idle_since = received.last;
            credit[0].send(u64_batch(read));
        }
        while let Some(batch) = end.recv() {
            expected = Some(u64_of(&batch)?);
        }
        allocator.release();
        if expected == Some(received.records) {
            break;
        }
        if read == 0 {
            if idle_since.elapsed() > PATIENCE {
                let records = received.records;
                return Err(format!("no data for {PATIENCE:?} after {records} records"));
            }
            allocator.await_events(Some(Duration::from_millis(10)));
        }
    }
    credit[0].done();
    allocator.release();
    Ok(received)
}

/// Worker 1 of the throughput run: counts records and payload bytes.
fn receive(mut allocator: Allocator, _options: &Options) -> Result<String, String> {
    let mut payload = 0u64;
    let received = receive_all(&mut allocator, |record| {
        std::hint::black_box(record.first());
        payload += record.len() as u64;
        Ok(())
    })?;
    let elapsed = received
        .last
        .duration_since(received.first.unwrap_or(received.last));
    Ok(format!(
        "received {} {payload} {}",
        received.records,
        elapsed.as_nanos()
    ))
}

/// The send time a latency run's warm-up record carries: it is not measured.
const WARM_UP: u64 = 0;

fn wall_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Waits until `scheduled` after `epoch` as `fluxgate bench` does: sleeps while far ahead,
/// yields when close. (The bench's `pace`, repeated because this crate is built apart from
/// the engine's: the same pacing is what makes the two latency runs comparable.)
fn pace(epoch: Instant, scheduled: Duration) {
    // Bounded by the schedule: each pass moves closer to it.
    loop {
        let now = epoch.elapsed();
        if now >= scheduled {
            return;
        }
        let ahead = scheduled - now;
        if ahead > Duration::from_micros(200) {
            std::thread::sleep(ahead - Duration::from_micros(100));
        } else {
            std::thread::yield_now();
        }
    }
}

/// Worker 0 of a latency run, as `fluxgate bench`'s: a warm-up record, answered before the
/// clock starts (so connecting is not measured); then one record every 1/rate s carrying its
/// *scheduled* send time, each its own message, published at once. The credit window of the
/// throughput run applies.
fn send_paced(mut allocator: Allocator, options: &Options) -> Result<String, String> {
    let mut sender = Sender::new(&mut allocator);
    let mut record = vec![0xA5u8; options.record_size];
    let send_record = |sender: &mut Sender, allocator: &mut Allocator, record: &[u8]| {
        sender.buffer.clear();
        put_length(&mut sender.buffer, record.len());
        sender.buffer.extend_from_slice(record);
        sender.push_buffer(allocator);
    };
    record[..8].copy_from_slice(&WARM_UP.to_le_bytes());
    send_record(&mut sender, &mut allocator, &record);
    // The receiver answers the warm-up at once.
    sender
        .wait_below(&mut allocator, 1, PATIENCE)
        .map_err(|e| format!("the warm-up record was not answered: {e}"))?;
    let epoch = Instant::now();
    let epoch_wall = wall_nanos();
    let interval = Duration::from_secs_f64(1.0 / options.rate as f64);
    let total = (options.rate as f64 * options.duration.as_secs_f64()) as u64;
    for i in 0..total {
        let scheduled = interval * i as u32;
        pace(epoch, scheduled);
        sender.wait_below(&mut allocator, options.window, PATIENCE)?;
        let sent = epoch_wall + scheduled.as_nanos() as u64;
        record[..8].copy_from_slice(&sent.to_le_bytes());
        send_record(&mut sender, &mut allocator, &record);
    }
    Ok(sender.finish(&mut allocator, total + 1))
}

/// Worker 1 of a latency run: the one-way latency of every record but the warm-up.
fn receive_latency(mut allocator: Allocator, _options: &Options) -> Result<String, String> {
    let mut histogram = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
        .map_err(|e| e.to_string())?;
    receive_all(&mut allocator, |record| {
        let now = wall_nanos();
        let sent: [u8; 8] = record
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or("a record shorter than its timestamp")?;
        let sent = u64::from_le_bytes(sent);
        if sent != WARM_UP {
            histogram.saturating_record(now.saturating_sub(sent).max(1));
        }
        Ok(())
    })?;
    let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
    Ok(format!(
        "latency {:.3} {:.3} {:.3} {:.3} {}",
        us(0.5),
        us(0.99),
        us(0.999),
        histogram.max() as f64 / 1000.0,
        histogram.len()
    ))
}

/// One process of the pair: builds timely's cluster allocator and runs its worker.
fn run_process(options: Options, process: usize) -> Result<(), String> {
    let config = Config::Cluster {
        threads: 1,
        process,
        addresses: options.addresses(),
        report: false,
        zerocopy: false,
    };
    let guards = timely_communication::initialize(config, move |allocator| {
        match (allocator.index(), options.rate) {
            (0, 0) => send(allocator, &options),
            (_, 0) => receive(allocator, &options),
            (0, _) => send_paced(allocator, &options),
            (_, _) => receive_latency(allocator, &options),
        }
    })?;
    for result in guards.join() {
        let line = result.map_err(|e| format!("worker: {e}"))??;
        println!("{line}");
    }
    // After the join: the communication threads have finished their work.
    println!("cpu_ns {}", own_cpu()?.as_nanos());
    Ok(())
}

/// Two consecutive free ports (timely's processes listen on theirs).
fn free_port_pair() -> Result<u16, String> {
    for _ in 0..100 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let port = first.local_addr().map_err(|e| e.to_string())?.port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return Ok(port);
        }
    }
    Err("no two consecutive free ports".into())
}

/// This process's user + system time, all threads, from `/proc/self/stat` (as `fluxgate
/// bench` reads it: no `unsafe`). USER_HZ is 100 on every Linux target.
fn own_cpu() -> Result<Duration, String> {
    let stat = std::fs::read_to_string("/proc/self/stat").map_err(|e| e.to_string())?;
    let (_, rest) = stat.rsplit_once(')').ok_or("unreadable /proc/self/stat")?;
    let mut fields = rest.split_whitespace().skip(11);
    let mut ticks = || -> Result<u64, String> {
        fields
            .next()
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| "unreadable /proc/self/stat".to_string())
    };
    let (utime, stime) = (ticks()?, ticks()?);
    Ok(Duration::from_millis((utime + stime) * 10))
}

/// Starts both processes, waits for them, prints the figures as `name value unit` lines.
fn run_pair(mut options: Options) -> Result<(), String> {
    if options.port == 0 {
        options.port = free_port_pair()?;
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let spawn = |process: usize| {
        Command::new(&exe)
            .args(["--record-size", &options.record_size.to_string()])
            .args(["--duration", &options.duration.as_secs_f64().to_string()])
            .args(["--window", &options.window.to_string()])
            .args(["--batch-bytes", &options.batch_bytes.to_string()])
            .args(["--port", &options.port.to_string()])
            .args(["--rate", &options.rate.to_string()])
            .args(["--process", &process.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting process {process}: {e}"))
    };
    let receiver = spawn(1)?;
    let sender = spawn(0)?;
    // A peer that never connects (a port taken between the probe and timely's bind) would
    // leave both waiting for ever: past the run and a minute of slack, both are killed.
    let pids = [receiver.id(), sender.id()];
    let deadline = options.duration + Duration::from_secs(60);
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if finished.recv_timeout(deadline).is_err() {
            eprintln!("no result after {deadline:?}: killing both processes");
            for pid in pids {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    });
    let sent = sender.wait_with_output().map_err(|e| e.to_string());
    let received = receiver.wait_with_output().map_err(|e| e.to_string());
    let _ = done.send(());
    let _ = watchdog.join();
    let (sent, received) = (sent?, received?);
    if !sent.status.success() || !received.status.success() {
        return Err(format!(
            "a process failed: sender {}, receiver {}",
            sent.status, received.status
        ));
    }
    let sent = String::from_utf8_lossy(&sent.stdout).into_owned();
    let received = String::from_utf8_lossy(&received.stdout).into_owned();
    let field = |output: &str, name: &str| -> Result<Vec<u64>, String> {
        let line = output
            .lines()
            .find(|line| line.starts_with(name))
            .ok_or_else(|| format!("no `{name}` line in: {output}"))?;
        Ok(line
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect())
    };
    let cpu_nanos: u64 = field(&sent, "cpu_ns")?.iter().sum::<u64>()
        + field(&received, "cpu_ns")?.iter().sum::<u64>();
    if options.rate > 0 {
        let line = received
            .lines()
            .find(|line| line.starts_with("latency"))
            .ok_or_else(|| format!("no `latency` line in: {received}"))?;
        let values: Vec<&str> = line.split_whitespace().skip(1).collect();
        let [p50, p99, p999, max, samples] = values[..] else {
            return Err(format!("unexpected receiver output: {received}"));
        };
        println!("latency_p50_us {p50} us");
        println!("latency_p99_us {p99} us");
        println!("latency_p999_us {p999} us");
        println!("latency_max_us {max} us");
        println!("latency_samples {samples} records");
        return Ok(());
    }
    let [records, payload, nanos] = field(&received, "received")?[..] else {
        return Err(format!("unexpected receiver output: {received}"));
    };
    let seconds = nanos as f64 / 1e9;
    println!("records {records} records");
    println!("records_per_sec {:.0} records/s", records as f64 / seconds);
    println!(
        "payload_gb_per_sec {:.3} GB/s",
        payload as f64 / seconds / 1e9
    );
    println!(
        "cpu_ns_per_record {:.3} ns",
        cpu_nanos as f64 / records as f64
    );
    Ok(())
}

fn main() -> ExitCode {
    let result = Options::parse().and_then(|options| match options.process {
        Some(process) => run_process(options, process),
        None => run_pair(options),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}
