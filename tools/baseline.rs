//! The raw-TCP baseline: the same record stream with no engine at all — plain blocking
//! loopback sockets, `[varint length | bytes]` records (the engine's wire format, LEB128
//! lengths) packed back to back into 32 KiB writes (throughput), or one write per record at a
//! fixed rate (latency). Every engine figure is printed beside it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::affinity::{self, Pinning};

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

/// `len` as the engine's length prefix appended to `out` (its encoding only; no engine code
/// runs on the baseline's data path).
fn put_length(out: &mut Vec<u8>, len: usize) {
    let mut prefix = [0; fluxgate::record::MAX_LENGTH_PREFIX];
    let used = fluxgate::record::encode_prefix(len as u32, &mut prefix);
    out.extend_from_slice(&prefix[..used]);
}

/// Counts the records in a byte stream of `[varint length | bytes]` records (split anywhere).
#[derive(Default)]
struct Counter {
    /// Bytes still to skip of the current record's body.
    body_left: usize,
    /// The length decoded so far, and how many of its bytes were seen.
    length: u64,
    length_bytes: u32,
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
            if self.length_bytes == 0 && bytes[0] < 0x80 {
                // A one-byte length, the body most likely in this read.
                let len = bytes[0] as usize;
                self.records += 1;
                self.payload += len as u64;
                if bytes.len() > len {
                    on_record(&bytes[1..1 + len]);
                    bytes = &bytes[1 + len..];
                } else {
                    self.body_left = len - (bytes.len() - 1);
                    bytes = &[];
                }
                continue;
            }
            let byte = bytes[0];
            bytes = &bytes[1..];
            self.length |= u64::from(byte & 0x7F) << (7 * self.length_bytes);
            self.length_bytes += 1;
            if byte < 0x80 {
                let len = self.length as usize;
                self.length = 0;
                self.length_bytes = 0;
                self.records += 1;
                self.payload += len as u64;
                if bytes.len() >= len {
                    on_record(&bytes[..len]);
                    bytes = &bytes[len..];
                } else {
                    self.body_left = len - bytes.len();
                    bytes = &[];
                }
            }
        }
    }
}

/// Runs `write` on the calling thread, pinned to the producer's CPU when `pinning` says so
/// (the reader, started before, stays on the consumer's), and gives the thread its CPUs back.
fn as_writer<T>(
    pinning: Option<Pinning>,
    write: impl FnOnce() -> std::io::Result<T>,
) -> std::io::Result<T> {
    let Some(pinning) = pinning else {
        return write();
    };
    let before = affinity::current_cpus().map_err(std::io::Error::other)?;
    affinity::pin_current_thread(pinning.producer).map_err(std::io::Error::other)?;
    let written = write();
    affinity::restore(&before).map_err(std::io::Error::other)?;
    written
}

/// Pins the calling thread (the reader) to the consumer's CPU when `pinning` says so.
fn as_reader(pinning: Option<Pinning>) -> std::io::Result<()> {
    match pinning {
        Some(pinning) => {
            affinity::pin_current_thread(pinning.consumer).map_err(std::io::Error::other)
        }
        None => Ok(()),
    }
}

/// Streams records of `record_size` bytes for `duration`.
pub fn throughput(
    record_size: usize,
    duration: Duration,
    pinning: Option<Pinning>,
) -> std::io::Result<Moved> {
    let (mut sender, mut receiver) = connected_pair()?;
    let started = Instant::now();
    let reader = thread::spawn(move || -> std::io::Result<(u64, u64)> {
        as_reader(pinning)?;
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
    as_writer(pinning, || {
        write_batches(&mut sender, record_size, started + duration)
    })?;
    let (records, payload_bytes) = reader
        .join()
        .map_err(|_| std::io::Error::other("baseline reader panicked"))??;
    Ok(Moved {
        records,
        payload_bytes,
        elapsed: started.elapsed(),
    })
}

/// The latency run's frames in a byte stream split anywhere: each frame is `[length | 8-byte
/// send time | rest]` of one fixed length, and is reported (with its send time) when its
/// last byte arrives, however many reads it took. (A record longer than a read was never
/// measured when only records whole in one read were.)
struct Stamps {
    /// Where the send time starts in a frame (after the length prefix).
    stamp_at: usize,
    frame_len: usize,
    /// Bytes of the current frame seen so far.
    seen: usize,
    stamp: [u8; 8],
}

impl Stamps {
    fn new(stamp_at: usize, frame_len: usize) -> Self {
        Self {
            stamp_at,
            frame_len,
            seen: 0,
            stamp: [0; 8],
        }
    }

    fn feed(&mut self, mut bytes: &[u8], mut on_frame: impl FnMut(u64)) {
        // Bounded by the input: every pass consumes at least one byte.
        while !bytes.is_empty() {
            let take = (self.frame_len - self.seen).min(bytes.len());
            // The part of the send time inside this piece.
            let from = self.stamp_at.max(self.seen);
            let to = (self.stamp_at + 8).min(self.seen + take);
            if from < to {
                self.stamp[from - self.stamp_at..to - self.stamp_at]
                    .copy_from_slice(&bytes[from - self.seen..to - self.seen]);
            }
            self.seen += take;
            bytes = &bytes[take..];
            if self.seen == self.frame_len {
                self.seen = 0;
                on_frame(u64::from_le_bytes(self.stamp));
            }
        }
    }
}

/// The throughput run's writer: records packed back to back into writes of exactly 32 KiB
/// until `until` (a record that does not fit is split across two, as the engine's span
/// segments), then the rest and the write side shut. Its own function with its buffers
/// local, not a closure over the caller's: through captured references the packing loop
/// reloads the vector on every record, which cost the 8-byte baseline about 2 ns per record.
fn write_batches(
    sender: &mut TcpStream,
    record_size: usize,
    until: Instant,
) -> std::io::Result<()> {
    let framed = fluxgate::record::framed_len(record_size);
    let mut batch = Vec::with_capacity(BATCH + framed);
    let record = vec![0xA5u8; record_size];
    // Where the next write starts in `batch`.
    let mut start = 0;
    while Instant::now() < until {
        for _ in 0..64 {
            while batch.len() - start < BATCH {
                put_length(&mut batch, record_size);
                batch.extend_from_slice(&record);
            }
            sender.write_all(&batch[start..start + BATCH])?;
            start += BATCH;
            if batch.len() - start < BATCH {
                // Less than a write left (a split record's tail): to the front, so a record
                // is moved at most once, whatever its size.
                batch.drain(..start);
                start = 0;
            }
        }
    }
    sender.write_all(&batch[start..])?;
    sender.shutdown(std::net::Shutdown::Write)
}

/// Sends `rate` records/s of `record_size` (≥ 8) bytes for `duration`, one write each, and
/// returns the one-way latency histogram (ns) measured from each record's scheduled send time.
pub fn latency(
    record_size: usize,
    rate: u64,
    duration: Duration,
    pinning: Option<Pinning>,
) -> std::io::Result<Histogram<u64>> {
    let (mut sender, mut receiver) = connected_pair()?;
    let size = record_size.max(8);
    let total = (rate as f64 * duration.as_secs_f64()) as u64;
    let mut frame = Vec::with_capacity(5 + size);
    put_length(&mut frame, size);
    let body = frame.len();
    frame.resize(body + size, 0);
    let frame_len = frame.len();
    let mut stamps = Stamps::new(body, frame_len);
    // A warm-up frame goes first, unmeasured, as the engine's run sends a warm-up record: the
    // reader's start, both threads' moves to their CPUs and the first wake-up are not the
    // latency of the exchange. The clock starts once the reader has it.
    let (warm_tx, warm_rx) = mpsc::channel::<()>();
    let (epoch_tx, epoch_rx) = mpsc::channel::<Instant>();
    let reader = thread::spawn(move || -> std::io::Result<Histogram<u64>> {
        as_reader(pinning)?;
        let mut histogram = super::bench::latency_histogram().map_err(std::io::Error::other)?;
        let mut buffer = vec![0u8; BATCH];
        // Exactly the warm-up frame: the measured ones start after it.
        let mut warm = 0;
        while warm < frame_len {
            let want = (frame_len - warm).min(buffer.len());
            match receiver.read(&mut buffer[..want])? {
                0 => return Ok(histogram),
                n => warm += n,
            }
        }
        let _ = warm_tx.send(());
        let Ok(epoch) = epoch_rx.recv() else {
            return Ok(histogram); // the writer failed; it reports why
        };
        loop {
            let n = receiver.read(&mut buffer)?;
            if n == 0 {
                return Ok(histogram);
            }
            let now = epoch.elapsed().as_nanos() as u64;
            stamps.feed(&buffer[..n], |sent| {
                super::bench::record_latency(&mut histogram, now.saturating_sub(sent));
            });
        }
    });
    as_writer(pinning, || {
        sender.write_all(&frame)?;
        warm_rx
            .recv()
            .map_err(|_| std::io::Error::other("the baseline reader ended at the warm-up"))?;
        let epoch = Instant::now();
        let _ = epoch_tx.send(epoch);
        for i in 0..total {
            let scheduled = super::bench::scheduled(i, rate);
            super::bench::pace(epoch, scheduled);
            frame[body..body + 8].copy_from_slice(&(scheduled.as_nanos() as u64).to_le_bytes());
            sender.write_all(&frame)?;
        }
        sender.shutdown(std::net::Shutdown::Write)
    })?;
    reader
        .join()
        .map_err(|_| std::io::Error::other("baseline reader panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_frames_split_anywhere_are_each_reported_once_with_their_stamp() {
        // A 2-byte length prefix, then the stamp, then the rest of a 300-byte record.
        let frame_len = 2 + 300;
        let mut stream = Vec::new();
        for stamp in [7u64, 1 << 40, u64::MAX] {
            stream.extend_from_slice(&[0xAC, 0x02]);
            stream.extend_from_slice(&stamp.to_le_bytes());
            stream.resize(stream.len() + 292, 0xEE);
        }
        for chunk in [1, 3, 8, 9, 301, 302, 303, stream.len()] {
            let mut stamps = Stamps::new(2, frame_len);
            let mut seen = Vec::new();
            for piece in stream.chunks(chunk) {
                stamps.feed(piece, |stamp| seen.push(stamp));
            }
            assert_eq!(seen, vec![7, 1 << 40, u64::MAX], "chunk {chunk}");
        }
    }

    #[test]
    fn the_counter_reads_varint_framed_records_split_anywhere() {
        let sizes = [0usize, 1, 8, 127, 128, 300, 16_383, 16_384, 20_000];
        let mut stream = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            put_length(&mut stream, size);
            stream.extend(std::iter::repeat_n(i as u8, size));
        }
        // Prefix widths as LEB128 has them: 1 byte under 128, 2 under 16 384, 3 above.
        let prefixes = 1 + 1 + 1 + 1 + 2 + 2 + 2 + 3 + 3;
        assert_eq!(stream.len(), sizes.iter().sum::<usize>() + prefixes);
        for chunk in [1, 2, 3, 7, 128, 4096, stream.len()] {
            let mut counter = Counter::default();
            let mut whole = Vec::new();
            for piece in stream.chunks(chunk) {
                counter.feed(piece, |record| whole.push(record.to_vec()));
            }
            assert_eq!(counter.records, sizes.len() as u64, "chunk {chunk}");
            assert_eq!(counter.payload, sizes.iter().sum::<usize>() as u64);
            if chunk == stream.len() {
                // One read holds every record whole: each is handed over.
                assert_eq!(whole.len(), sizes.len());
            }
            // Records seen whole inside one read have the right bytes.
            for record in &whole {
                let index = sizes
                    .iter()
                    .position(|&s| s == record.len())
                    .expect("a size");
                assert!(record.iter().all(|&b| b == index as u8), "chunk {chunk}");
            }
        }
    }
}
