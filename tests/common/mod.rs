//! What the integration tests that run on both drivers share: `#[macro_use] mod common;`.

use std::time::{Duration, Instant};

use fluxgate::io::Transport;

// Each test binary that includes this module uses some of it.
#[allow(dead_code)]
/// Runs `test` on `transport`; on io_uring only where the kernel allows it (and says so
/// loudly where it does not).
pub fn on(transport: Transport, test: impl FnOnce(Transport)) {
    if transport == Transport::Uring && skip_without_uring("this io_uring test") {
        return;
    }
    test(transport);
}

#[allow(dead_code)]
/// True (after a `SKIPPED:` line naming `test` and the reason) where the kernel refuses
/// io_uring.
pub fn skip_without_uring(test: &str) -> bool {
    match fluxgate::io::uring::probe() {
        Ok(()) => false,
        Err(reason) => {
            eprintln!("SKIPPED: {test}: io_uring unavailable: {reason}");
            true
        }
    }
}

/// One test per driver: `on_both_drivers!(body, body_epoll, body_uring)`.
#[allow(unused_macros)]
macro_rules! on_both_drivers {
    ($test:ident, $epoll:ident, $uring:ident) => {
        #[test]
        fn $epoll() {
            common::on(fluxgate::io::Transport::Epoll, $test);
        }

        #[test]
        fn $uring() {
            common::on(fluxgate::io::Transport::Uring, $test);
        }
    };
}

/// Looks at `condition` until it holds or `timeout` passed; true if it held. A bounded wait
/// on a condition, not a sleep: it looks again after 20 µs at first, then backs off (to 5 ms
/// between looks), so a long wait does not take a vCPU from the threads it waits for.
#[allow(dead_code)]
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(20);
    // Bounded by the deadline.
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::park_timeout(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// One record as the serializer frames it, `[LEB128 length | bytes]`, written out here
/// rather than by the crate's encoder (what tests compare against must not come from it).
#[allow(dead_code)]
pub fn framed_record(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut len = bytes.len();
    while len >= 0x80 {
        out.push((len as u8) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
    out.extend_from_slice(bytes);
    out
}

/// A child's stdout, a line at a time, from a thread that ends with the child: waits for a
/// line can then be bounded (`recv_timeout`).
#[allow(dead_code)]
pub fn stdout_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let stdout = std::io::BufReader::new(child.stdout.take().expect("stdout piped"));
    let (sender, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// A child test process whose every wait is bounded by `within`: its stdout lines come
/// through [`stdout_lines`], and it is killed and reaped when dropped (a failing test leaves
/// none behind).
#[allow(dead_code)]
pub struct ChildProcess {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    within: Duration,
}

#[allow(dead_code)]
impl ChildProcess {
    /// `child` must have its stdout piped.
    pub fn new(mut child: std::process::Child, within: Duration) -> Self {
        let lines = stdout_lines(&mut child);
        Self {
            child,
            lines,
            within,
        }
    }

    /// The next stdout line (silence or the child's exit is a test failure).
    pub fn line(&mut self) -> String {
        match self.lines.recv_timeout(self.within) {
            Ok(line) => line,
            Err(error) => panic!(
                "no line from the child ({error}); it exited: {:?}",
                self.child.try_wait()
            ),
        }
    }

    /// Writes a line to the child's (piped) stdin.
    pub fn say(&mut self, text: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("stdin piped");
        writeln!(stdin, "{text}").expect("the child reads");
    }

    /// Its exit status.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        let mut status = None;
        let exited = wait_until(self.within, || {
            status = self.child.try_wait().expect("the child can be waited for");
            status.is_some()
        });
        assert!(exited, "the child did not exit within {:?}", self.within);
        status.expect("exited")
    }

    /// What it printed and nobody read yet (after its exit: everything left).
    pub fn rest(&self) -> Vec<String> {
        // The reader thread ends with the child's stdout; each line bounded.
        std::iter::from_fn(|| self.lines.recv_timeout(self.within).ok()).collect()
    }

    /// SIGKILL: no orderly close, the kernel closes its sockets.
    pub fn kill(&mut self) {
        self.child.kill().expect("the child can be killed");
        self.child.wait().expect("reaped");
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[allow(dead_code)]
/// How long segments still in flight (in a socket, an I/O thread, a reader) may take to come
/// back to their pools.
pub const POOLS_REFILL: Duration = Duration::from_secs(20);

#[allow(dead_code)]
/// Waits (at most [`POOLS_REFILL`]) until every environment's pool is full again; false, with
/// each pool's count and the environment's dump on stderr, if one never fills.
pub fn pools_full(envs: &[&fluxgate::ShuffleEnvironment]) -> bool {
    let full = |e: &&fluxgate::ShuffleEnvironment| {
        e.network().available_segments() == e.network().total_segments()
    };
    if wait_until(POOLS_REFILL, || envs.iter().all(full)) {
        return true;
    }
    for env in envs {
        eprintln!(
            "{}: {} of {} segments free\n{}",
            env.local_addr(),
            env.network().available_segments(),
            env.network().total_segments(),
            env.debug_dump()
        );
    }
    false
}

#[allow(dead_code)]
/// [`pools_full`] of one environment.
pub fn pool_full(env: &fluxgate::ShuffleEnvironment) -> bool {
    pools_full(&[env])
}

#[allow(dead_code)]
/// Producer `producer`'s record `seq`: its identity (producer and sequence number,
/// big-endian), then filler of a length that varies from a few bytes to past a TLS record
/// (16 KiB) and a segment (8 KiB): every 97th record is 20 000 bytes longer.
pub fn record(producer: usize, seq: u64) -> Vec<u8> {
    let len =
        (seq.wrapping_mul(2654435761) % 600) as usize + if seq % 97 == 0 { 20_000 } else { 0 };
    let mut bytes = Vec::with_capacity(16 + len);
    bytes.extend_from_slice(&(producer as u64).to_be_bytes());
    bytes.extend_from_slice(&seq.to_be_bytes());
    bytes.resize(16 + len, (seq % 251) as u8);
    bytes
}

#[allow(dead_code)]
/// Emits producer `producer`'s records `0..records` ([`record`]) round robin with a buffer
/// timeout of `timeout_ms`, an aligned checkpoint barrier after every `barrier_every` records
/// (ids from 1) when given, then finishes the partition.
pub fn write_records(
    partition: fluxgate::partition::ResultPartition,
    producer: usize,
    records: u64,
    timeout_ms: i64,
    barrier_every: Option<u64>,
) {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
    use fluxgate::partition::{BufferTimeout, RecordWriter, RoundRobinSelector};
    let mut writer = RecordWriter::new(
        partition,
        RoundRobinSelector::default(),
        BufferTimeout::from_millis(timeout_ms),
    );
    for seq in 0..records {
        writer.emit(&record(producer, seq)[..]).unwrap();
        if let Some(every) = barrier_every.filter(|every| (seq + 1) % every == 0) {
            let barrier = Event::CheckpointBarrier(CheckpointBarrier {
                id: (seq + 1) / every,
                timestamp: 0,
                kind: CheckpointKind::Checkpoint,
                alignment: Alignment::Aligned,
            });
            writer.broadcast_event(&barrier, false).unwrap();
        }
    }
    writer.finish().unwrap();
}

/// A loopback listener that never completes another connection: its accept queue (backlog
/// 0 holds one) is filled by a connection nobody accepts, so the kernel drops every later
/// SYN and a connect to it hangs until the connector's timeout, as to a host whose firewall
/// drops packets. Returns the listener and the filling connection, to keep them open.
#[allow(dead_code)]
pub fn black_hole() -> (socket2::Socket, std::net::TcpStream) {
    use socket2::{Domain, Socket, Type};
    let listener = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    listener.bind(&any.into()).unwrap();
    listener.listen(0).unwrap();
    let addr = listener.local_addr().unwrap().as_socket().unwrap();
    let filler = std::net::TcpStream::connect(addr).unwrap();
    (listener, filler)
}

/// A barrier aligned with a timeout of `timeout_ms`, of a checkpoint that started
/// `started_ms_ago` milliseconds ago (its timestamp is the checkpoint's start, on the wall
/// clock, as Flink's).
#[allow(dead_code)]
pub fn timeoutable_barrier(
    id: u64,
    timeout_ms: u64,
    started_ms_ago: i64,
) -> fluxgate::event::Event {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64;
    Event::CheckpointBarrier(CheckpointBarrier {
        id,
        timestamp: now_ms - started_ms_ago,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::AlignedWithTimeout { timeout_ms },
    })
}

/// A channel-state sink that records what it was given.
#[allow(dead_code)]
#[derive(Default)]
pub struct RecordingSink {
    pub data: std::sync::Mutex<Vec<(u64, usize, Vec<u8>)>>,
    /// Partial records, then buffers, per checkpoint and channel in the order they came.
    pub stream: std::sync::Mutex<Vec<(u64, usize, Vec<u8>)>>,
    pub complete: std::sync::Mutex<Vec<u64>>,
    pub aborted: std::sync::Mutex<Vec<u64>>,
}

impl fluxgate::gate::ChannelStateSink for RecordingSink {
    fn add_input_data(&self, checkpoint_id: u64, channel: usize, buffer: fluxgate::buffer::Buffer) {
        let bytes = buffer.as_slice().to_vec();
        self.stream
            .lock()
            .unwrap()
            .push((checkpoint_id, channel, bytes.clone()));
        self.data
            .lock()
            .unwrap()
            .push((checkpoint_id, channel, bytes));
    }

    fn add_partial_record(&self, checkpoint_id: u64, channel: usize, bytes: &[u8]) {
        self.stream
            .lock()
            .unwrap()
            .push((checkpoint_id, channel, bytes.to_vec()));
    }

    fn input_complete(&self, checkpoint_id: u64) {
        self.complete.lock().unwrap().push(checkpoint_id);
    }

    fn abort(&self, checkpoint_id: u64) {
        self.aborted.lock().unwrap().push(checkpoint_id);
    }
}

#[allow(dead_code)]
impl RecordingSink {
    /// The channel state of `channel` for `checkpoint`, as one byte stream in order.
    pub fn channel_state(&self, checkpoint: u64, channel: usize) -> Vec<u8> {
        self.stream
            .lock()
            .unwrap()
            .iter()
            .filter(|(id, c, _)| (*id, *c) == (checkpoint, channel))
            .flat_map(|(_, _, bytes)| bytes.iter().copied())
            .collect()
    }
}

/// A pool that takes every free segment of `network` and holds them (another task's pool
/// that grew while the global pool had segments), with the segments it holds.
#[allow(dead_code)]
pub fn hog_every_segment(
    network: &fluxgate::buffer::NetworkBufferPool,
) -> (
    fluxgate::buffer::LocalBufferPool,
    Vec<fluxgate::buffer::PooledSegment>,
) {
    let hog = network
        .create_local_pool(fluxgate::buffer::LocalPoolSpec {
            min_segments: 1,
            max_segments: usize::MAX,
            subpartitions: 0,
            max_segments_per_channel: usize::MAX,
            max_listeners: 1,
            max_overdraft_segments: 0,
        })
        .unwrap();
    let held = std::iter::from_fn(|| hog.request_segment()).collect();
    (hog, held)
}

/// A thread emitting 100-byte records to subpartition 0 of `partition` until one fails or
/// 100 went out (more than a segment's rest), with where its last result arrives; the
/// thread returns the partition.
#[allow(dead_code)]
pub fn writer_until_failure(
    mut partition: fluxgate::partition::ResultPartition,
) -> (
    std::thread::JoinHandle<fluxgate::partition::ResultPartition>,
    std::sync::mpsc::Receiver<Result<(), fluxgate::partition::PartitionError>>,
) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || {
        let mut result = Ok(());
        for _ in 0..100 {
            result = partition.emit_record(&[2u8; 100][..], 0);
            if result.is_err() {
                break;
            }
        }
        done_tx.send(result).unwrap();
        partition
    });
    (writer, done_rx)
}

#[allow(dead_code)]
/// The process's resident memory in bytes (`VmRSS`). Queue slots are written when they are
/// made, so what they take is resident at once.
pub fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let kib: usize = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse().ok())
        .expect("a VmRSS line in kB");
    kib * 1024
}

#[allow(dead_code)]
/// The highest descriptor this process has open now.
pub fn highest_descriptor() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .expect("procfs")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .max()
        .expect("some descriptor is open")
}

#[allow(dead_code)]
/// Fills subpartition 0 of `output` with 1000-byte records until it takes no more without
/// waiting for memory (bounded), and makes them readable.
pub fn back_pressure(output: &mut fluxgate::partition::ResultPartition) {
    let record = [7u8; 1000];
    for _ in 0..10_000 {
        if !output.is_available() {
            break;
        }
        output.emit_record(&record[..], 0).unwrap();
    }
    output.flush_all();
    assert!(!output.is_available(), "the output is back-pressured");
}
