//! The raw-TCP baseline: the same record stream with no engine at all — plain blocking
//! loopback sockets, `[u32 length | bytes]` records packed back to back into 32 KiB writes
//! (throughput), or one write per record at a fixed rate (latency). Every engine figure is
//! printed beside it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Bytes per write of the throughput run (a segment's worth, as the engine sends).
const BATCH: usize = 32 * 1024;

/// What a baseline throughput run moved.
#[derive(Debug)]
pub struct Moved {
    pub records: u64,
    pub payload_bytes: u64,
    pub elapsed: Duration,
}

fn connected_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let sender = TcpStream::connect(listener.local_addr()?)?;
    let (receiver, _) = listener.accept()?;
    sender.set_nodelay(true)?;
    receiver.set_nodelay(true)?;
    Ok((sender, receiver))
}

/// Counts the records in a byte stream of `[u32 length | bytes]` records (split anywhere).
#[derive(Default)]
struct Counter {
    /// Bytes still to skip of the current record's body.
    body_left: usize,
    prefix: [u8; 4],
    prefix_len: usize,
    records: u64,
    payload: u64,
}

impl Counter {
    fn feed(&mut self, mut bytes: &[u8], mut on_record: impl FnMut(&[u8])) {
        // Bounded by the input: every pass consumes bytes.
        while !bytes.is_empty() {
            if self.body_left > 0 {
                let take = self.body_left.min(bytes.len());
                self.body_left -= take;
                bytes = &bytes[take..];
                continue;
            }
            if self.prefix_len == 0 && bytes.len() >= 4 {
                let len = u32::from_be_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
                self.records += 1;
                self.payload += len as u64;
                if bytes.len() >= 4 + len {
                    on_record(&bytes[4..4 + len]);
                    bytes = &bytes[4 + len..];
                } else {
                    self.body_left = len - (bytes.len() - 4);
                    bytes = &[];
                }
                continue;
            }
            let take = (4 - self.prefix_len).min(bytes.len());
            self.prefix[self.prefix_len..self.prefix_len + take].copy_from_slice(&bytes[..take]);
            self.prefix_len += take;
            bytes = &bytes[take..];
            if self.prefix_len == 4 {
                self.prefix_len = 0;
                let len = u32::from_be_bytes(self.prefix) as usize;
                self.records += 1;
                self.payload += len as u64;
                self.body_left = len;
            }
        }
    }
}

/// Streams records of `record_size` bytes for `duration`.
pub fn throughput(record_size: usize, duration: Duration) -> std::io::Result<Moved> {
    let (mut sender, mut receiver) = connected_pair()?;
    let started = Instant::now();
    let reader = thread::spawn(move || -> std::io::Result<(u64, u64)> {
        let mut counter = Counter::default();
        let mut buffer = vec![0u8; BATCH];
        loop {
            let n = receiver.read(&mut buffer)?;
            if n == 0 {
                return Ok((counter.records, counter.payload));
            }
            counter.feed(&buffer[..n], |_| {});
        }
    });
    let mut batch = Vec::with_capacity(BATCH + record_size + 4);
    let record = vec![0xA5u8; record_size];
    while started.elapsed() < duration {
        for _ in 0..64 {
            // Pack records back to back; write a full batch at a time.
            while batch.len() + 4 + record_size <= BATCH {
                batch.extend_from_slice(&(record_size as u32).to_be_bytes());
                batch.extend_from_slice(&record);
            }
            sender.write_all(&batch)?;
            batch.clear();
        }
    }
    sender.shutdown(std::net::Shutdown::Write)?;
    let (records, payload_bytes) = reader
        .join()
        .map_err(|_| std::io::Error::other("baseline reader panicked"))??;
    Ok(Moved {
        records,
        payload_bytes,
        elapsed: started.elapsed(),
    })
}

/// Sends `rate` records/s of `record_size` (≥ 8) bytes for `duration`, one write each, and
/// returns the one-way latency histogram (ns) measured from each record's scheduled send time.
pub fn latency(
    record_size: usize,
    rate: u64,
    duration: Duration,
) -> std::io::Result<Histogram<u64>> {
    let (mut sender, mut receiver) = connected_pair()?;
    let epoch = Instant::now();
    let reader = thread::spawn(move || -> std::io::Result<Histogram<u64>> {
        let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let mut counter = Counter::default();
        let mut buffer = vec![0u8; BATCH];
        loop {
            let n = receiver.read(&mut buffer)?;
            if n == 0 {
                return Ok(histogram);
            }
            let now = epoch.elapsed().as_nanos() as u64;
            counter.feed(&buffer[..n], |record| {
                if record.len() >= 8 {
                    let sent = u64::from_le_bytes(record[..8].try_into().expect("8 bytes"));
                    histogram.saturating_record(now.saturating_sub(sent).max(1));
                }
            });
        }
    });
    let size = record_size.max(8);
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let total = (rate as f64 * duration.as_secs_f64()) as u64;
    let mut frame = vec![0u8; 4 + size];
    frame[..4].copy_from_slice(&(size as u32).to_be_bytes());
    for i in 0..total {
        let scheduled = interval * i as u32;
        super::bench::pace(epoch, scheduled);
        frame[4..12].copy_from_slice(&(scheduled.as_nanos() as u64).to_le_bytes());
        sender.write_all(&frame)?;
    }
    sender.shutdown(std::net::Shutdown::Write)?;
    reader
        .join()
        .map_err(|_| std::io::Error::other("baseline reader panicked"))?
}
