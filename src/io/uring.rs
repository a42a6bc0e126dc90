//! The io_uring driver: one I/O thread owning one ring, with the same behaviour as the
//! [`epoll`](super::epoll) driver over the same connection state machines.
//!
//! Per connection exactly one read is in flight (a `Readv` of `[destination, read-ahead]`, as
//! the epoll driver reads) and at most one write (a `Writev` of the frame bytes, segment
//! payloads in place, control bytes copied into a per-connection staging area first; a
//! `WriteFixed` when the write is one range of a registered segment); short
//! writes continue with the next write. A write to a non-loopback peer that starts with at
//! least 16 KiB of segment bytes goes out as a zero-copy send instead (`SendZc` from the
//! registered arena for one range, `SendMsgZc` for several; `fluxgate.network.zero-copy-send`);
//! a connection whose notification says the kernel copied anyway goes back to plain writes.
//! Sockets are used through a sparse registered-file table (slot = connection slot, cleared
//! when the connection closes) where the kernel allows one, else through their descriptors.
//! The listener keeps one `Accept` armed and an eventfd keeps one `Read` armed for wake-ups.
//! The submissions of a loop turn go to the kernel together, in the `io_uring_enter` that
//! also waits (bounded) for the next completion; a turn whose reads filled their buffers
//! enters up to 16 times more without waiting, to read on (`READ_ROUNDS`).
//!
//! Memory the kernel may touch stays put until its completion arrives:
//!
//! * Each connection lives in a `Box` that is neither moved nor dropped while one of its
//!   operations is in flight; the iovec arrays, the staging area and the read-ahead area live
//!   there (allocated once per connection, reused by every operation).
//! * A read's destination is the state machine's current read buffer; the state machine only
//!   moves on (or drops a payload segment) in `on_read` / `on_lost`, which this driver calls
//!   only once no read is in flight; except when shutdown gives up waiting for one, and then
//!   takes the payload segment out first and leaks it.
//! * A write's segments are held by the state machine's outbound queue, which keeps them past
//!   a failure until `on_written` (`Connection::begin_write`).
//! * A zero-copy send's segments are needed until its notification (a second completion,
//!   `IORING_CQE_F_NOTIF`), not just its own completion: the outbound queue holds frames leaving it while any zero-copy send of the
//!   connection is unnotified (tagged with the newest one), and lets them go once every send
//!   up to the tag is notified. The next write does not wait for notifications. A connection
//!   closing with sends unnotified hands its held segments to the loop (`orphans`), which drops
//!   them on the last notification; the socket closes meanwhile (its queued data then goes or
//!   is reset, which is what ends the notifications).
//! * A connection that fails or closes gets its operations cancelled; `on_lost` runs and the
//!   socket closes when their completions are in. On shutdown everything in flight is
//!   cancelled and drained; what does not drain in time is leaked, never freed.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, IoSlice, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::task::Waker;
use std::thread;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};

use super::conn::{Connection, Side};
use super::{
    client_for, listener_failed_for_good, refuse_connection, BusyPoll, Command, DriverConfig,
    DriverHandle, DriverStats, IoWaker, PendingConnects, RefusedConnects, WakeFn, ACCEPT_BACKOFF,
    SHUTDOWN_REASON,
};
use crate::buffer::Buffer;
use crate::partition::PartitionManager;
use crate::protocol::ServerConnection;
use crate::sync::ArrayQueue;

/// Submission queue entries of a ring.
const SQ_ENTRIES: u32 = 256;
/// Completion queue entries. Not room for everything in flight at the most connections
/// (a read and a write each, and zero-copy notifications): the kernel keeps completions
/// beyond it (`IORING_FEAT_NODROP`, Linux 5.5, older than the `IORING_FEAT_EXT_ARG` the
/// probe requires) and hands them over at the next enter; only if it could
/// not allocate that room does the enter fail (`EBADR`), and the thread with it.
const CQ_ENTRIES: u32 = 1024;
/// Longest the thread sleeps without a completion (it then checks timeouts).
const MAX_PARK: Duration = Duration::from_millis(100);
/// Longest the thread sleeps after the full submission queue refused a submission (its
/// flush failed: completions the kernel could not post yet, or no memory): the next turn
/// retries it, after reaping.
const REFUSED_PARK: Duration = Duration::from_millis(1);
/// Slices handed to one `Writev`.
const MAX_SLICES: usize = 64;
/// Most extra read rounds per loop turn (see `Loop::read_on`).
const READ_ROUNDS: usize = 16;
/// Bytes of control frames (and of anything outside the network memory) copied per write.
const STAGING: usize = 16 * 1024;
/// How long shutdown waits for cancelled operations to complete.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(5);
/// TCP_USER_TIMEOUT of a closed connection kept for its unnotified zero-copy sends: a peer
/// that acknowledges nothing for that long is dropped by the kernel, which frees the sends'
/// segments (the kernel's own bound for a closed socket, `tcp_orphan_retries`, does not
/// apply to one a process still holds).
const ORPHAN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a shutdown waits for zero-copy notifications before it aborts the sockets that
/// still owe some ([`Loop::abort_unnotified_sockets`]): a live peer acknowledges well within
/// it, so what its socket still sends is not cut short.
const ZC_ABORT_GRACE: Duration = Duration::from_secs(1);

/// Operation kinds in the low bits of a submission's user data; the slot and the slot's
/// generation are above them.
const KIND_BITS: u32 = 3;
const ACCEPT: u64 = 0;
const WAKE: u64 = 1;
const READ: u64 = 2;
const WRITE: u64 = 3;
const CANCEL: u64 = 4;
/// A zero-copy send: the slot bits name its record in `Loop::zc_sends`, not a connection.
const ZC_WRITE: u64 = 5;
/// The slot of operations that belong to no connection.
const NO_SLOT: usize = (1 << (32 - KIND_BITS)) - 1;

/// Opcodes the driver needs; [`probe`] checks them.
const REQUIRED: [(&str, u8); 5] = [
    ("READV", opcode::Readv::CODE),
    ("WRITEV", opcode::Writev::CODE),
    ("ACCEPT", opcode::Accept::CODE),
    ("READ", opcode::Read::CODE),
    ("ASYNC_CANCEL", opcode::AsyncCancel::CODE),
];

/// Segment bytes a write must carry (in one run from its start) to go out as a zero-copy
/// send: below this the notification costs more than the copy it saves.
const ZC_MIN_BYTES: usize = 16 * 1024;
/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel copied anyway.
const SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in a notification's result.
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;
/// Most slots of a ring's registered-file table; connections in slots past it use plain
/// descriptors.
const FILE_TABLE_MAX: usize = 1 << 14;

static TUNED_SETUP_REFUSED: AtomicBool = AtomicBool::new(false);
static FIXED_BUFFERS_REFUSED: AtomicBool = AtomicBool::new(false);
static FILES_REFUSED: AtomicBool = AtomicBool::new(false);
static ZC_UNSUPPORTED: AtomicBool = AtomicBool::new(false);
static ZC_REFUSED: AtomicBool = AtomicBool::new(false);

/// Builds an operation on a connection's socket: through its registered file when it has
/// one (`types::Fixed`), else through its descriptor. `$build` is expanded for each.
macro_rules! on_socket {
    ($file:expr, $fd:expr, |$target:ident| $build:expr) => {
        match $file {
            Some(index) => {
                let $target = types::Fixed(index);
                $build
            }
            None => {
                let $target = types::Fd($fd);
                $build
            }
        }
    };
}

/// What an `io_uring_enter` returned, with the outcomes that only mean "nothing more this
/// time" taken as success: the wait timed out (ETIME), a signal interrupted it (EINTR), or the
/// completion queue is full or the kernel is short of memory for now (EBUSY, EAGAIN; the next
/// reap makes room and the unsubmitted entries stay queued).
fn entered(result: io::Result<usize>) -> io::Result<()> {
    match result {
        Err(error)
            if !matches!(
                error.raw_os_error(),
                Some(libc::ETIME | libc::EINTR | libc::EBUSY | libc::EAGAIN)
            ) =>
        {
            Err(error)
        }
        _ => Ok(()),
    }
}

fn user_data(kind: u64, slot: usize, generation: u32) -> u64 {
    debug_assert!(slot <= NO_SLOT);
    kind | (((slot as u64) << KIND_BITS) & 0xFFFF_FFFF) | (u64::from(generation) << 32)
}

fn split_user_data(data: u64) -> (u64, usize, u32) {
    (
        data & ((1 << KIND_BITS) - 1),
        ((data & 0xFFFF_FFFF) >> KIND_BITS) as usize,
        (data >> 32) as u32,
    )
}

/// Whether this process can run the io_uring driver: `kernel.io_uring_disabled` is not 2, a
/// ring can be created, it supports the wait timeout (`IORING_FEAT_EXT_ARG`, Linux 5.11) and
/// every opcode the driver uses. The error says what is missing. A verdict that lasts is
/// kept for the process; a passing shortage (no descriptor or memory for the ring just then)
/// is probed again next time, so one bad moment does not leave every later environment on
/// epoll.
pub fn probe() -> Result<(), String> {
    static PROBED: OnceLock<Result<(), String>> = OnceLock::new();
    if let Some(verdict) = PROBED.get() {
        return verdict.clone();
    }
    match probe_now() {
        Probed::Lasting(verdict) => PROBED.get_or_init(|| verdict).clone(),
        Probed::Passing(reason) => Err(reason),
    }
}

/// What one probe found.
enum Probed {
    /// Holds for the life of the process.
    Lasting(Result<(), String>),
    /// A shortage of the moment: the next probe may pass.
    Passing(String),
}

fn probe_now() -> Probed {
    let setup_failed = |error: io::Error, what: String| match error.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN | libc::EINTR) => {
            Probed::Passing(what)
        }
        _ => Probed::Lasting(Err(what)),
    };
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .map(|s| s.trim().to_owned());
    if sysctl.as_deref() == Some("2") {
        return Probed::Lasting(Err(
            "kernel.io_uring_disabled = 2 (io_uring is off for every process)".into(),
        ));
    }
    let ring = match IoUring::new(8) {
        Ok(ring) => ring,
        Err(error) => {
            let hint = match (error.raw_os_error(), sysctl.as_deref()) {
                (Some(libc::EPERM), Some("1")) => {
                    " (kernel.io_uring_disabled = 1: only privileged processes or kernel.io_uring_group)"
                }
                (Some(libc::EPERM), _) => " (blocked, e.g. by a seccomp profile)",
                (Some(libc::ENOSYS), _) => " (kernel without io_uring, or a sandbox hiding it)",
                (Some(libc::ENOMEM), _) => " (locked-memory limit)",
                _ => "",
            };
            let what = format!("creating a ring failed: {error}{hint}");
            return setup_failed(error, what);
        }
    };
    Probed::Lasting(check_ring(&ring))
}

/// Whether `ring`'s kernel has what the driver uses.
fn check_ring(ring: &IoUring) -> Result<(), String> {
    if !ring.params().is_feature_ext_arg() {
        return Err("the kernel lacks IORING_FEAT_EXT_ARG (wait timeouts, Linux 5.11)".into());
    }
    let mut probe = Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|error| format!("probing opcodes failed: {error}"))?;
    let missing: Vec<&str> = REQUIRED
        .iter()
        .filter(|(_, code)| !probe.is_supported(*code))
        .map(|(name, _)| *name)
        .collect();
    if !missing.is_empty() {
        return Err(format!("unsupported opcodes: {}", missing.join(", ")));
    }
    Ok(())
}

/// Keeps SIGPIPE away from this thread. A write into a connection its peer reset (or that a
/// cancel shut down) fails with `EPIPE`, and the kernel also raises SIGPIPE at the thread that
/// issued it unless the write says `MSG_NOSIGNAL`, which `Writev` and `WriteFixed` cannot.
/// The signal's default action ends the process; Rust's runtime ignores it, but a host that
/// embeds the engine need not. Blocked here, the thread-directed signal stays pending on this
/// thread and is never acted on. (io_uring's worker threads block every signal already.)
fn block_sigpipe_on_this_thread() {
    // SAFETY: `set` is initialised by `sigemptyset` before it is read, and
    // `pthread_sigmask` changes only the calling thread's mask (no old mask is asked for).
    let blocked = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if blocked != 0 {
        tracing::warn!(
            error = %io::Error::from_raw_os_error(blocked),
            "io_uring: could not block SIGPIPE on the I/O thread"
        );
    }
}

/// A ring with SINGLE_ISSUER and DEFER_TASKRUN when the kernel takes them, else a plain one.
/// Must be built on the thread that submits (SINGLE_ISSUER binds the ring to it).
fn build_ring() -> io::Result<IoUring> {
    let tuned = IoUring::builder()
        .setup_cqsize(CQ_ENTRIES)
        .setup_submit_all()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(SQ_ENTRIES);
    match tuned {
        Ok(ring) => Ok(ring),
        Err(error) => {
            if !TUNED_SETUP_REFUSED.swap(true, Ordering::Relaxed) {
                tracing::info!(
                    %error,
                    "io_uring: SINGLE_ISSUER/DEFER_TASKRUN ring setup refused; using plain setup"
                );
            }
            IoUring::builder()
                .setup_cqsize(CQ_ENTRIES)
                .build(SQ_ENTRIES)
                .or_else(|_| IoUring::new(SQ_ENTRIES))
        }
    }
}

/// A blocking eventfd (a read armed on it waits in the ring, never spins on EAGAIN).
fn eventfd() -> io::Result<File> {
    // SAFETY: plain FFI call without pointer arguments.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd(2), is open, and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// A running io_uring I/O thread.
pub struct UringDriver {
    handle: DriverHandle,
}

impl std::fmt::Debug for UringDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringDriver")
            .field("local_addr", &self.handle.local_addr)
            .finish()
    }
}

impl UringDriver {
    /// Creates the ring on a new I/O thread and serves `manager`'s partitions on `listener`.
    /// Fails when the listener or the ring cannot be set up.
    pub fn start(
        listener: TcpListener,
        config: DriverConfig,
        manager: Arc<PartitionManager>,
    ) -> io::Result<Self> {
        if config.tls.is_some() {
            // Connections here would run in plaintext: refuse rather than downgrade.
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "TLS runs on the epoll driver only",
            ));
        }
        // The ring's Accept waits for a connection on its own. A listener handed over
        // non-blocking (`ShuffleEnvironment::start_on`, e.g. a service manager's socket) made
        // kernels before 5.19 complete it at once with EAGAIN, and the loop, re-arming it
        // every turn, would never sleep.
        listener.set_nonblocking(false)?;
        let local_addr = listener.local_addr()?;
        let wake_file = Arc::new(eventfd()?);
        let writer = wake_file.clone();
        let waker: Arc<IoWaker<WakeFn>> = Arc::new(IoWaker::new(Box::new(move || {
            // A failed wake leaves the thread to its bounded park.
            let _ = (&*writer).write(&1u64.to_ne_bytes());
        })));
        let commands = Arc::new(ArrayQueue::new(4096));
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread = {
            let commands = commands.clone();
            let waker = waker.clone();
            thread::Builder::new()
                .name("fluxgate-io-uring".into())
                .spawn(move || {
                    crate::buffer::mark_io_thread();
                    block_sigpipe_on_this_thread();
                    let ring = match build_ring() {
                        Ok(ring) => ring,
                        Err(error) => {
                            let _ = ready_tx.send(Err(error));
                            return;
                        }
                    };
                    let mut io_loop =
                        Loop::new(ring, listener, wake_file, commands, waker, config, manager);
                    io_loop.setup();
                    let _ = ready_tx.send(Ok(()));
                    if panic::catch_unwind(AssertUnwindSafe(|| io_loop.run())).is_err() {
                        // The hook reported the panic. The channels must still hear that
                        // nothing serves them any more, or they wait for good; what is in
                        // flight is cancelled (or leaked by `Drop`), never freed under the
                        // kernel.
                        tracing::error!("the io_uring I/O thread panicked; its channels fail");
                        io_loop.end();
                    }
                })?
        };
        let started = ready_rx
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("the io_uring thread ended while starting")));
        if let Err(error) = started {
            let _ = thread.join();
            return Err(error);
        }
        Ok(Self {
            handle: DriverHandle {
                commands,
                waker,
                thread: Some(thread),
                local_addr,
            },
        })
    }

    /// The running thread's command queue, waker and listening address.
    pub(crate) fn handle(&self) -> &DriverHandle {
        &self.handle
    }

    pub(crate) fn handle_mut(&mut self) -> &mut DriverHandle {
        &mut self.handle
    }
}

/// A connection and everything its in-flight operations point into. Boxed: never moves.
struct Conn {
    stream: TcpStream,
    connection: Connection,
    peer: Option<(SocketAddr, usize)>,
    generation: u32,
    /// A read is in flight into `read_iov`.
    reading: bool,
    read_iov: [libc::iovec; 2],
    read_destination_len: usize,
    /// A write is in flight from `write_iov`.
    writing: bool,
    write_iov: Vec<libc::iovec>,
    /// Bytes the write in flight asked for.
    write_len: usize,
    /// Copies of the bytes of the write in flight that are not in the network memory.
    staging: Vec<u8>,
    /// The user data of the write in flight (a plain write's, or its zero-copy record's).
    write_data: u64,
    /// The header of a `SendMsgZc` in flight (its iovecs are `write_iov`).
    msghdr: libc::msghdr,
    /// The socket's slot in the ring's registered-file table.
    file: Option<u32>,
    /// Writes may go out as zero-copy sends (the peer is not on loopback, nothing reported a
    /// copy yet, and the loop may use them).
    zero_copy: bool,
    /// Tags of this connection's zero-copy sends whose notification has not arrived, in
    /// ascending order; their segments are held by the outbound queue until then.
    zc_pending: VecDeque<u64>,
    /// The tag of the next zero-copy send.
    zc_next: u64,
    /// No more reads (the state machine failed or the connection closes).
    stop_reading: bool,
    /// A protocol error: close once the queued error response is written (one attempt).
    close_after_write: bool,
    /// When a connection closing after a protocol error closes even if its peer never read
    /// enough for the error response to go out ([`ERROR_RESPONSE_LINGER`]).
    ///
    /// [`ERROR_RESPONSE_LINGER`]: super::ERROR_RESPONSE_LINGER
    close_by: Option<Instant>,
    /// The write in flight was submitted after `close_after_write` was set: the error
    /// response's one attempt.
    writing_after_error: bool,
    /// Closing: `on_lost(reason)` and the socket's close wait for the operations in flight.
    closing: Option<String>,
    cancelled: bool,
}

impl Conn {
    fn idle(&self) -> bool {
        !self.reading && !self.writing
    }

    fn connection_peer(&self) -> Option<SocketAddr> {
        self.stream.peer_addr().ok()
    }

    /// Every zero-copy send tagged below this has been notified.
    fn zc_done_below(&self) -> u64 {
        self.zc_pending.front().copied().unwrap_or(self.zc_next)
    }

    /// The zero-copy send `tag` is over (notified, or completed without a notification to
    /// come): the segments no unnotified send may read go back to their pools.
    fn zc_finished(&mut self, tag: u64) {
        if let Some(at) = self.zc_pending.iter().position(|&t| t == tag) {
            self.zc_pending.remove(at);
        }
        let done_below = self.zc_done_below();
        self.connection.release_sent(done_below);
    }
}

/// A zero-copy send submitted: whose it is, and which of its two completions arrived.
#[derive(Debug)]
struct ZcSend {
    slot: usize,
    generation: u32,
    tag: u64,
    /// The send's own completion arrived.
    completed: bool,
    notified: bool,
}

/// A closed connection's segments that zero-copy sends not notified yet may still read.
#[derive(Debug)]
struct Orphan {
    slot: usize,
    generation: u32,
    pending: VecDeque<u64>,
    /// Dropped (back to their pools) once `pending` is empty.
    held: Vec<Buffer>,
    /// The socket, kept open (its write side shut, so the peer saw the close) until the
    /// notifications are in: a shutdown aborts it ([`abort_connection`]) so that a peer that
    /// stopped acknowledging does not hold the segments until the kernel gives up on it.
    socket: Option<TcpStream>,
}

struct Loop {
    // Dropped first: the kernel lets go of the registered arenas before `config.network`
    // (which keeps them mapped) may unmap them.
    ring: IoUring,
    listener: TcpListener,
    accept_armed: bool,
    accept_paused_until: Option<Instant>,
    /// The last accept failed: the next failures of the streak are logged at debug level.
    accept_failing: bool,
    wake_file: Arc<File>,
    /// Where the armed eventfd read puts the counter (never read by us).
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    conns: Vec<Option<Box<Conn>>>,
    free_slots: Vec<usize>,
    next_generation: u32,
    /// Outgoing connections by (peer, connection index).
    peers: HashMap<(SocketAddr, usize), usize>,
    /// Channels whose connection was refused, to try again.
    refused: RefusedConnects,
    /// Channels waiting for a connection a helper thread is opening.
    pending: PendingConnects,
    /// Accepted (server-side) connections open now, closing ones included.
    accepted: usize,
    /// Reads, writes, the accept and the eventfd read submitted and not completed.
    in_flight: usize,
    commands: Arc<ArrayQueue<Command>>,
    waker: Arc<IoWaker<WakeFn>>,
    std_waker: Waker,
    config: DriverConfig,
    manager: Arc<PartitionManager>,
    /// The network memory's arenas as (start address, length); a slice inside one is segment
    /// bytes held by the outbound queue, written in place.
    arenas: Vec<(usize, usize)>,
    /// The arenas (of `config.network`) are registered as fixed buffers (buffer index =
    /// arena index).
    fixed: bool,
    /// Slots of the registered-file table (0: sockets are used through their descriptors);
    /// a connection in slot `i < file_table` has its socket in file slot `i`.
    file_table: usize,
    /// Zero-copy sends may be used (config `auto` and the kernel supports them).
    zc_available: bool,
    /// Zero-copy sends whose completions have not all arrived (user data slot = index).
    zc_sends: Vec<Option<ZcSend>>,
    zc_free: Vec<usize>,
    /// Closed connections' segments waiting for notifications.
    orphans: Vec<Orphan>,
    /// Reused storage for `write_slices` (empty between uses).
    slice_scratch: Vec<IoSlice<'static>>,
    /// Slots whose last read filled every byte it offered (the socket likely holds more),
    /// and the reused list a read round works through.
    full_reads: Vec<usize>,
    read_round: Vec<usize>,
    /// Reads since the gate wake-ups the loop holds were last given (see `READS_PER_WAKE`).
    reads_held: usize,
    /// Reused storage for reaped completions.
    cqe_scratch: Vec<(u64, i32, u32)>,
    /// The next of `cqe_scratch` to handle (past 0 only while a reap runs, or after a panic
    /// ended one).
    cqe_next: usize,
    shutting_down: bool,
    /// Operation counts, logged at shutdown (debug) and reported by `Command::Stats`.
    stats: DriverStats,
    /// Set when a turn connected a channel: work for [`BusyPoll`], besides the completions
    /// [`Loop::reap`] counts.
    worked: bool,
    /// This turn a submission was refused ([`Loop::push`]); the next turn retries it.
    push_refused: bool,
    /// Refusals since the last submission queued (the first of a streak is logged).
    refusal_streak: u64,
}

impl Drop for Loop {
    /// After a panic (or an undrained shutdown) operations may still be in flight: their
    /// memory is leaked rather than freed under the kernel. The ring (dropped right after)
    /// cancels them.
    fn drop(&mut self) {
        if self.in_flight == 0 {
            return;
        }
        for conn in self.conns.iter_mut() {
            if conn
                .as_ref()
                .is_some_and(|c| !c.idle() || !c.zc_pending.is_empty())
            {
                std::mem::forget(conn.take());
            }
        }
        for mut orphan in self.orphans.drain(..) {
            // The kernel lets go of the segments only after the notifications, which no
            // one will wait for: they are leaked, the socket reset and closed.
            if let Some(socket) = orphan.socket.take() {
                abort_connection(&socket);
            }
            std::mem::forget(orphan);
        }
        if self.wake_armed {
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new([0; 8])));
        }
    }
}

impl super::ClientConnections for Loop {
    type Handle = usize;

    fn open_connection(&self, peer: SocketAddr, index: usize) -> Option<usize> {
        let slot = *self.peers.get(&(peer, index))?;
        self.live(slot)
            .is_some_and(|conn| !conn.close_after_write && conn.connection.has_room())
            .then_some(slot)
    }

    fn add_client(
        &mut self,
        stream: TcpStream,
        peer: SocketAddr,
        index: usize,
    ) -> io::Result<usize> {
        // Blocking socket: io_uring polls it itself.
        let client = client_for(peer, &self.config)?;
        let slot = self.add(stream, Side::Client(client), Some((peer, index)));
        self.peers.insert((peer, index), slot);
        tracing::debug!(%peer, index, "connection opened");
        Ok(slot)
    }

    fn client(&mut self, slot: usize) -> &mut crate::protocol::ClientConnection {
        let conn = self.conns[slot].as_mut().expect("a live connection");
        conn.connection.client_mut()
    }

    fn connects(&mut self) -> super::Connects<'_> {
        super::Connects {
            config: &self.config,
            commands: &self.commands,
            waker: &self.waker,
            pending: &mut self.pending,
            refused: &mut self.refused,
        }
    }
}

impl Loop {
    fn new(
        ring: IoUring,
        listener: TcpListener,
        wake_file: Arc<File>,
        commands: Arc<ArrayQueue<Command>>,
        waker: Arc<IoWaker<WakeFn>>,
        config: DriverConfig,
        manager: Arc<PartitionManager>,
    ) -> Self {
        let arenas = config
            .network
            .as_ref()
            .map(|n| {
                n.arenas()
                    .iter()
                    .map(|a| (a.base as usize, a.len))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            ring,
            listener,
            accept_armed: false,
            accept_paused_until: None,
            accept_failing: false,
            wake_file,
            wake_buf: Box::new([0; 8]),
            wake_armed: false,
            conns: Vec::new(),
            free_slots: Vec::new(),
            next_generation: 0,
            peers: HashMap::new(),
            refused: RefusedConnects::default(),
            pending: PendingConnects::default(),
            accepted: 0,
            in_flight: 0,
            commands,
            std_waker: Waker::from(waker.clone()),
            waker,
            config,
            manager,
            arenas,
            fixed: false,
            file_table: 0,
            zc_available: false,
            zc_sends: Vec::new(),
            zc_free: Vec::new(),
            orphans: Vec::new(),
            slice_scratch: Vec::with_capacity(MAX_SLICES),
            cqe_scratch: Vec::with_capacity(CQ_ENTRIES as usize),
            cqe_next: 0,
            full_reads: Vec::with_capacity(16),
            reads_held: 0,
            read_round: Vec::with_capacity(16),
            shutting_down: false,
            stats: DriverStats::default(),
            worked: false,
            push_refused: false,
            refusal_streak: 0,
        }
    }

    /// Probes the optional opcodes once, registers the arenas and a sparse file table, and
    /// decides whether zero-copy sends may be used. Every failure falls back (logged once per
    /// process) and changes nothing else.
    fn setup(&mut self) {
        let mut probe = Probe::new();
        let probed = self.ring.submitter().register_probe(&mut probe).is_ok();
        if probed && probe.is_supported(opcode::WriteFixed::CODE) {
            self.register_arenas();
        }
        self.register_files();
        let zc_supported = probed
            && probe.is_supported(opcode::SendZc::CODE)
            && probe.is_supported(opcode::SendMsgZc::CODE);
        self.zc_available = zc_supported && self.config.zero_copy_send != crate::ZeroCopySend::Off;
        self.stats.zc_available = self.zc_available;
        if !zc_supported
            && self.config.zero_copy_send != crate::ZeroCopySend::Off
            && !ZC_UNSUPPORTED.swap(true, Ordering::Relaxed)
        {
            tracing::info!(
                "io_uring: the kernel lacks IORING_OP_SEND_ZC / IORING_OP_SENDMSG_ZC (Linux 6.1); \
                 no zero-copy sends"
            );
        }
    }

    /// A sparse registered-file table, one slot per connection slot (up to the configured
    /// connections plus room for outgoing ones); sockets then are `types::Fixed`.
    fn register_files(&mut self) {
        let nofile = {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes the `rlimit` we pass, which lives across the call.
            let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
            if ok {
                usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
            } else {
                1024
            }
        };
        // Saturating: `max-connections` is only bounded below.
        let size = self
            .config
            .max_connections
            .saturating_add(256)
            .min(FILE_TABLE_MAX)
            .min(nofile / 2)
            .max(1);
        match self.ring.submitter().register_files_sparse(size as u32) {
            Ok(()) => {
                self.file_table = size;
                self.stats.file_table_size = size as u64;
            }
            Err(error) => {
                if !FILES_REFUSED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %error,
                        size,
                        "io_uring: registering a file table failed; sockets are used through \
                         plain descriptors"
                    );
                }
            }
        }
    }

    /// Registers the network memory's arenas as fixed buffers (single-slice writes from a
    /// segment then use `WriteFixed`). Failure (e.g. the locked-memory limit) is logged once
    /// per process and changes nothing else.
    fn register_arenas(&mut self) {
        if self.arenas.is_empty() || self.arenas.len() > usize::from(u16::MAX) {
            return;
        }
        let iovecs: Vec<libc::iovec> = self
            .arenas
            .iter()
            .map(|&(base, len)| libc::iovec {
                iov_base: base as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        // SAFETY: the arenas are mappings of `self.config.network`, which this loop holds until
        // after the ring is dropped (field order), so they stay valid while registered.
        match unsafe { self.ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => {
                self.fixed = true;
                tracing::debug!(arenas = iovecs.len(), "io_uring: network memory registered");
            }
            Err(error) => {
                if !FIXED_BUFFERS_REFUSED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %error,
                        "io_uring: registering the network memory as fixed buffers failed; \
                         using non-fixed writes"
                    );
                }
            }
        }
    }

    fn run(&mut self) {
        let mut busy_poll = BusyPoll::new(self.config.busy_poll);
        loop {
            self.stats.turns += 1;
            // A refusal of the last turn is retried by this one's pumps.
            self.push_refused = false;
            if !self.drain_commands() {
                break;
            }
            let now = Instant::now();
            if std::mem::take(&mut self.worked) {
                busy_poll.worked(now);
            }
            super::connects_due(self, now);
            for slot in 0..self.conns.len() {
                self.pump(slot, now);
            }
            self.arm_listener_and_wake(now);
            // Busy-polling (this turn's drain and pumps saw the work a parked thread would be
            // woken for), or park: announce it, then look once more for work that raced the
            // announcement.
            let wait = self.waker.prepare_wait(&mut busy_poll, now, || {
                // A shutdown asked for without a command (`request_shutdown`) is work too.
                let mut busy = !self.commands.is_empty() || self.waker.is_shutdown_requested();
                for conn in self.conns.iter().flatten() {
                    if conn.closing.is_none() {
                        // Registered for the wake-up; work only what the next turn can send
                        // (`has_pending`, looked at after the registration): a ready reader
                        // behind a full outgoing queue, or on a connection closing after its
                        // last write, is no reason not to park.
                        conn.connection.set_waker(&self.std_waker);
                        busy |= !conn.close_after_write && conn.connection.has_pending();
                    }
                }
                busy
            });
            let timeout = if wait.at_once() {
                Duration::ZERO
            } else if self.push_refused {
                // Not the usual park: what was refused goes out on the next turn. Nor in the
                // kernel: an enter that cannot submit everything it holds returns at once
                // (the shortage that refused it), and the loop would spin.
                self.pause_after_refusal(self.next_timeout(now));
                Duration::ZERO
            } else {
                self.next_timeout(now)
            };
            if !timeout.is_zero() {
                self.stats.sleeps += 1;
            }
            let entered = self.enter(timeout);
            self.waker.end_wait(wait);
            if let Err(error) = entered {
                tracing::error!(%error, "io_uring_enter failed; the I/O thread stops");
                break;
            }
            let now = Instant::now();
            // Readers woken once for this turn's reads (and every `READS_PER_WAKE` of them),
            // when its completions and read-on rounds are handled (see `hold_wakes`); the
            // other completions handled meanwhile (writes, accepts, closes) do not block.
            let wakes = crate::gate::hold_wakes();
            if self.reap(now) > 0 {
                busy_poll.worked(now);
            }
            self.read_on();
            drop(wakes);
            self.reads_held = 0;
        }
        self.end();
    }

    /// The loop has ended (shutdown, an OS error, or a panic): commands are refused from now
    /// on, and the connections close (see [`Loop::shutdown`]).
    fn end(&mut self) {
        super::io_thread_stopped(&self.commands, &self.waker);
        self.shutdown();
    }

    /// Reads again, before the next turn's writes, from every socket whose last read filled
    /// all it offered, for at most [`READ_ROUNDS`] rounds: the epoll driver reads a socket dry
    /// in the same way. Without it a busy connection gets one read per loop turn, and the
    /// writes queued between two such short turns leave in many small `writev`s (measured:
    /// 17 KB a write against epoll's 100 KB, and 30 % fewer records through a 3-node stress
    /// run).
    fn read_on(&mut self) {
        for _ in 0..READ_ROUNDS {
            if self.full_reads.is_empty() {
                break;
            }
            std::mem::swap(&mut self.full_reads, &mut self.read_round);
            while let Some(slot) = self.read_round.pop() {
                let readable = self
                    .live(slot)
                    .is_some_and(|conn| !conn.reading && !conn.stop_reading);
                if readable {
                    self.submit_read(slot);
                }
            }
            // A read of data already there completes inside this call; one that finds none
            // stays in flight, as it would after the next turn's submission.
            if let Err(error) = self.enter(Duration::ZERO) {
                tracing::warn!(%error, "io_uring_enter failed while reading on");
                break;
            }
            self.reap(Instant::now());
        }
        self.full_reads.clear();
    }

    /// Submits everything queued and waits up to `timeout` for a completion; a zero `timeout`
    /// does not wait at all ([`Loop::enter_without_waiting`]).
    fn enter(&mut self, timeout: Duration) -> io::Result<()> {
        self.stats.enters += 1;
        if timeout.is_zero() {
            return self.enter_without_waiting();
        }
        let timespec = types::Timespec::from(timeout);
        let args = types::SubmitArgs::new().timespec(&timespec);
        entered(self.ring.submitter().submit_with_args(1, &args))
    }

    /// Submits everything queued and runs the ring's deferred work (completing what is ready),
    /// without waiting. A wait for one completion with a zero timeout is not the same: when
    /// nothing is ready the kernel arms a timer and sleeps until it fires, a context switch
    /// and tens of microseconds on a loaded machine (measured: a busy-polling thread ran once
    /// every 20–30 µs that way).
    fn enter_without_waiting(&mut self) -> io::Result<()> {
        let queued = self.ring.submission().len() as u32;
        // GETEVENTS with no minimum: deferred task work (DEFER_TASKRUN) runs only in an enter
        // that carries it, and the kernel returns as soon as that work is done.
        let flags = io_uring::EnterFlags::GETEVENTS.bits();
        // SAFETY: every queued entry was pushed through `push`, whose contract keeps the
        // memory it points to valid until its completion is reaped. The arguments are what
        // `Submitter::submit_and_wait` passes: `queued` is exactly the submission queue's
        // length, and without EXT_ARG the `None` argument is a null signal mask the kernel
        // ignores. The ring has no SQPOLL thread, so no SQ_WAKEUP flag is needed.
        entered(unsafe {
            self.ring
                .submitter()
                .enter::<libc::sigset_t>(queued, 0, flags, None)
        })
    }

    /// Handles every completion the ring holds; returns how many of them were work for
    /// [`BusyPoll`]: not the wake eventfd's read (a bare wake-up, e.g. a flusher that found
    /// nothing to flush) nor a cancellation.
    fn reap(&mut self, now: Instant) -> usize {
        // Completions taken off the ring but not handled (a panic ended the last reap; see
        // `Loop::end`) come first: their operations still count in `in_flight`, and what
        // they finished (a read's segment, an accepted socket) is handled, not lost.
        self.cqe_scratch.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result(), cqe.flags())),
        );
        let mut work = 0;
        while let Some(&(data, result, flags)) = self.cqe_scratch.get(self.cqe_next) {
            self.cqe_next += 1;
            work += usize::from(!matches!(split_user_data(data).0, WAKE | CANCEL));
            self.complete(data, result, flags, now);
        }
        self.cqe_scratch.clear();
        self.cqe_next = 0;
        work
    }

    fn next_timeout(&self, now: Instant) -> Duration {
        self.conns
            .iter()
            .flatten()
            .filter(|c| c.closing.is_none())
            .flat_map(|c| c.connection.poll_timeout().into_iter().chain(c.close_by))
            .chain(self.accept_paused_until)
            .chain(self.refused.next_due())
            .chain(self.pending.next_overdue())
            .min()
            .map_or(MAX_PARK, |due| due.saturating_duration_since(now))
            .min(MAX_PARK)
    }

    /// Queues a submission; flushes the queue to the kernel when it is full. False when the
    /// entry could not be queued (it is then not in flight).
    ///
    /// # Safety
    ///
    /// Every buffer and iovec `entry` points to must stay valid (and not be accessed through
    /// Rust references in a conflicting way) until its completion has been reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> bool {
        for _ in 0..2 {
            // SAFETY: forwarded to the caller.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                self.refusal_streak = 0;
                return true;
            }
            if let Err(error) = self.ring.submit() {
                self.refused(&error);
                return false;
            }
        }
        self.refused(&io::Error::other("the submission queue stayed full"));
        false
    }

    /// Sleeps [`REFUSED_PARK`] (at most `limit`) in user space after a refused submission,
    /// before the retry: the kernel's wait would not (see [`Loop::run`]).
    fn pause_after_refusal(&mut self, limit: Duration) {
        self.stats.sleeps += 1;
        std::thread::sleep(limit.min(REFUSED_PARK));
    }

    /// A submission could not be queued: the next turn retries it soon.
    fn refused(&mut self, error: &io::Error) {
        self.push_refused = true;
        self.refusal_streak += 1;
        if self.refusal_streak == 1 {
            tracing::warn!(%error, "io_uring: a submission was refused; retrying every turn");
        } else {
            tracing::debug!(%error, streak = self.refusal_streak, "io_uring: submission refused");
        }
    }

    fn arm_listener_and_wake(&mut self, now: Instant) {
        if !self.accept_armed
            && !self.stats.listener_failed
            && self.accept_paused_until.is_none_or(|until| now >= until)
        {
            self.accept_paused_until = None;
            let entry = opcode::Accept::new(
                types::Fd(self.listener.as_raw_fd()),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(user_data(ACCEPT, NO_SLOT, 0));
            // SAFETY: no address buffer is passed; the listener stays open while the loop
            // lives, and shutdown cancels this accept and waits for it.
            if unsafe { self.push(&entry) } {
                self.accept_armed = true;
                self.in_flight += 1;
            }
        }
        if !self.wake_armed {
            let entry = opcode::Read::new(
                types::Fd(self.wake_file.as_raw_fd()),
                self.wake_buf.as_mut_ptr(),
                8,
            )
            .build()
            .user_data(user_data(WAKE, NO_SLOT, 0));
            // SAFETY: `wake_buf` is a box owned by the loop and never read or written by Rust
            // code; shutdown cancels this read and waits for it (or leaks the box).
            if unsafe { self.push(&entry) } {
                self.wake_armed = true;
                self.in_flight += 1;
            }
        }
    }

    /// Returns false on shutdown.
    fn drain_commands(&mut self) -> bool {
        if self.waker.is_shutdown_requested() {
            return false;
        }
        while let Some(command) = self.commands.pop() {
            match command {
                Command::Shutdown => return false,
                Command::Dump(reply) => {
                    let mut out = format!("io_uring {:?}\n", self.stats_now());
                    for (slot, conn) in self.conns.iter_mut().enumerate() {
                        if let Some(conn) = conn {
                            conn.connection.describe(&slot, &mut out);
                            out.push_str(&format!(
                                "  file {:?} zero-copy {} unnotified zero-copy sends {} \
                                 held segments {}\n",
                                conn.file,
                                conn.zero_copy,
                                conn.zc_pending.len(),
                                conn.connection.held_segments()
                            ));
                        }
                    }
                    let _ = reply.send(out);
                }
                Command::Stats(reply) => {
                    let _ = reply.send(self.stats_now());
                }
                Command::Connect {
                    peer,
                    connection_index,
                    channel,
                } => {
                    self.worked = true;
                    let backoff = self.config.request_backoff;
                    let now = Instant::now();
                    super::connect_channel(self, peer, connection_index, channel, backoff, now);
                }
                Command::Connected {
                    peer,
                    connection_index,
                    attempt,
                    result,
                } => {
                    self.worked = true;
                    super::on_connected(
                        self,
                        peer,
                        connection_index,
                        attempt,
                        result,
                        Instant::now(),
                    );
                }
            }
        }
        true
    }

    fn stats_now(&self) -> DriverStats {
        let mut stats = self.stats.clone();
        stats.open_connections = self.conns.iter().flatten().count() as u64;
        stats.file_slots_in_use = self
            .conns
            .iter()
            .flatten()
            .filter(|c| c.file.is_some())
            .count() as u64;
        stats.zc_orphaned_segments = self.orphans.iter().map(|o| o.held.len() as u64).sum();
        stats
    }

    fn live(&self, slot: usize) -> Option<&Conn> {
        self.conns
            .get(slot)?
            .as_deref()
            .filter(|c| c.closing.is_none())
    }

    fn add(&mut self, stream: TcpStream, side: Side, peer: Option<(SocketAddr, usize)>) -> usize {
        let peer_addr = stream.peer_addr().ok();
        // Loopback peers never (unless `always`): the kernel copies every looped zero-copy
        // packet anyway.
        let zero_copy = self.zc_available
            && (self.config.zero_copy_send == crate::ZeroCopySend::Always
                || peer_addr.is_some_and(|a| !a.ip().to_canonical().is_loopback()));
        // Generation 0 is never a connection's.
        self.next_generation = self.next_generation.wrapping_add(1).max(1);
        let conn = Box::new(Conn {
            stream,
            connection: Connection::new(side, peer_addr),
            peer,
            generation: self.next_generation,
            reading: false,
            read_iov: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2],
            read_destination_len: 0,
            writing: false,
            write_iov: Vec::with_capacity(MAX_SLICES),
            write_len: 0,
            staging: Vec::with_capacity(STAGING),
            write_data: 0,
            // SAFETY: `msghdr` is plain data; all zeroes is a valid value (null pointers, zero
            // lengths, no flags).
            msghdr: unsafe { std::mem::zeroed() },
            file: None,
            zero_copy,
            zc_pending: VecDeque::new(),
            zc_next: 0,
            stop_reading: false,
            close_after_write: false,
            close_by: None,
            writing_after_error: false,
            closing: None,
            cancelled: false,
        });
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.conns[slot] = Some(conn);
                slot
            }
            None => {
                self.conns.push(Some(conn));
                self.conns.len() - 1
            }
        };
        self.register_file(slot);
        slot
    }

    /// Puts a new connection's socket into file slot `slot` (the table's slot of a closed
    /// connection was cleared when it closed). Past the table or on failure: its descriptor.
    fn register_file(&mut self, slot: usize) {
        if slot >= self.file_table {
            return;
        }
        let conn = self.conns[slot].as_deref_mut().expect("just added");
        let fd = conn.stream.as_raw_fd();
        match self
            .ring
            .submitter()
            .register_files_update(slot as u32, &[fd])
        {
            Ok(1) => {
                conn.file = Some(slot as u32);
                self.stats.files_registered += 1;
                self.stats.file_slots_high_water =
                    self.stats.file_slots_high_water.max(slot as u64 + 1);
            }
            outcome => {
                if !FILES_REFUSED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        ?outcome,
                        slot,
                        "io_uring: registering a socket in the file table failed; it is used \
                         through its descriptor"
                    );
                }
            }
        }
    }

    /// Clears a closing connection's file slot (nothing of it is in flight), so the socket
    /// closes with its descriptor and the slot can take the next connection's.
    fn unregister_file(&mut self, conn: &mut Conn) {
        let Some(index) = conn.file.take() else {
            return;
        };
        if let Err(error) = self.ring.submitter().register_files_update(index, &[-1]) {
            // The table keeps the socket open until the slot's next connection replaces it.
            tracing::warn!(%error, index, "io_uring: clearing a file slot failed");
        }
    }

    /// One connection's turn: collect what to send, keep a write and a read in flight, close
    /// when done.
    fn pump(&mut self, slot: usize, now: Instant) {
        let Some(conn) = self.conns.get_mut(slot).and_then(|c| c.as_deref_mut()) else {
            return;
        };
        if conn.closing.is_some() {
            self.cancel(slot);
            self.finish_close(slot);
            return;
        }
        if conn.close_by.is_some_and(|by| now >= by) {
            // The peer never read the error response: close anyway (cancelling the write).
            self.begin_close(
                slot,
                "protocol error; its response was not read in time".into(),
            );
            return;
        }
        if !conn.close_after_write {
            conn.connection.poll_transmit(now);
        }
        if !conn.writing && conn.connection.wants_write() {
            self.submit_write(slot);
        }
        let conn = self.conns[slot].as_deref_mut().expect("present");
        if !conn.reading && !conn.stop_reading {
            self.submit_read(slot);
        }
        let conn = self.conns[slot].as_deref_mut().expect("present");
        if !conn.writing
            && !conn.connection.wants_write()
            && (conn.close_after_write || conn.connection.is_closing())
        {
            self.begin_close(slot, "connection closed".into());
        }
    }

    fn submit_read(&mut self, slot: usize) {
        let conn = self.conns[slot].as_deref_mut().expect("present");
        let (destination, ahead) = conn.connection.read_targets();
        conn.read_destination_len = destination.len();
        conn.read_iov = [
            libc::iovec {
                iov_base: destination.as_mut_ptr().cast(),
                iov_len: destination.len(),
            },
            libc::iovec {
                iov_base: ahead.as_mut_ptr().cast(),
                iov_len: ahead.len(),
            },
        ];
        let iov = conn.read_iov.as_ptr();
        let entry = on_socket!(conn.file, conn.stream.as_raw_fd(), |socket| {
            opcode::Readv::new(socket, iov, 2).build()
        })
        .user_data(user_data(READ, slot, conn.generation));
        let on_file = conn.file.is_some();
        // SAFETY: `read_iov` lives in the boxed `Conn`, which is neither moved nor dropped
        // before this read's completion (`finish_close` and shutdown wait for `reading` to
        // clear). The iovecs point at the state machine's read buffer and read-ahead area;
        // the state machine frees them only in `on_read` / `on_lost` (and drop), which run
        // only after the completion, and nothing reads or writes those bytes meanwhile. (A
        // client's handshake deadline, in `poll_transmit`, may fail the connection first: it
        // resets the reader's counters but frees nothing, and a payload segment, which it
        // would drop, is never a read's target before the handshake ended; `on_read` then
        // drops the bytes of a closed connection unread.) The socket stays open until then
        // too. The one exception is a shutdown
        // that gave up waiting (`abandon_busy_connections`): its `on_lost` may reset the read
        // state under the kernel's write, but that connection is leaked, never read again
        // nor freed.
        if unsafe { self.push(&entry) } {
            let conn = self.conns[slot].as_deref_mut().expect("present");
            conn.reading = true;
            self.in_flight += 1;
            self.stats.reads += 1;
            self.count_socket_op(on_file);
        }
    }

    fn count_socket_op(&mut self, on_file: bool) {
        if on_file {
            self.stats.fixed_file_ops += 1;
        } else {
            self.stats.plain_fd_ops += 1;
        }
    }

    fn submit_write(&mut self, slot: usize) {
        let arenas = &self.arenas;
        let fixed = self.fixed;
        let zc_available = self.zc_available;
        let conn = self.conns[slot].as_deref_mut().expect("present");
        let Conn {
            stream,
            connection,
            write_iov,
            staging,
            generation,
            file,
            zero_copy,
            msghdr,
            ..
        } = conn;
        write_iov.clear();
        staging.clear();
        // Reuse the scratch allocation for this borrow's slices (an empty vector's storage
        // carries over: same element layout, collected in place).
        let mut slices: Vec<IoSlice<'_>> = std::mem::take(&mut self.slice_scratch)
            .into_iter()
            .map(|_| unreachable!("the scratch is empty"))
            .collect();
        connection.write_slices(&mut slices, MAX_SLICES);
        let mut fixed_index = None;
        // The run of segment slices the write starts with: iovecs and bytes.
        let mut run = Some((0usize, 0usize));
        for slice in &slices {
            let start = slice.as_ptr() as usize;
            let arena = arenas
                .iter()
                .position(|&(base, len)| start >= base && start + slice.len() <= base + len);
            if arena.is_some() {
                // Segment bytes: held by the outbound queue until `on_written` (and, after a
                // zero-copy send, until its notification).
                write_iov.push(libc::iovec {
                    iov_base: slice.as_ptr() as *mut libc::c_void,
                    iov_len: slice.len(),
                });
                if let Some((iovecs, bytes)) = run.as_mut() {
                    *iovecs += 1;
                    *bytes += slice.len();
                }
                fixed_index = arena;
                continue;
            }
            run = run.filter(|&(_, bytes)| bytes >= ZC_MIN_BYTES);
            if run.is_some() && *zero_copy && zc_available {
                // The write ends before these control bytes: the zero-copy run goes alone.
                break;
            }
            // Control bytes (or memory we cannot vouch for): copy; the staging area never
            // grows past its capacity, so earlier copies do not move.
            let take = slice.len().min(STAGING - staging.len());
            if take == 0 {
                break;
            }
            let at = staging.len();
            staging.extend_from_slice(&slice[..take]);
            write_iov.push(libc::iovec {
                iov_base: staging.as_ptr().wrapping_add(at) as *mut libc::c_void,
                iov_len: take,
            });
            if take < slice.len() {
                break;
            }
        }
        slices.clear();
        self.slice_scratch = slices
            .into_iter()
            .map(|_| unreachable!("cleared"))
            .collect();
        if write_iov.is_empty() {
            return;
        }
        // Zero-copy: the peer is off loopback, nothing reported a copy yet, and the write is
        // one run of at least ZC_MIN_BYTES segment bytes (no staged control bytes, whose
        // area the next write reuses before a notification could come).
        let zc = zc_available
            && *zero_copy
            && staging.is_empty()
            && run
                .is_some_and(|(iovecs, bytes)| iovecs == write_iov.len() && bytes >= ZC_MIN_BYTES);
        let requested: usize = write_iov.iter().map(|v| v.iov_len).sum();
        let fd = stream.as_raw_fd();
        let on_file = file.is_some();
        self.stats.copied_bytes += staging.len() as u64;
        let single = (write_iov.len() == 1).then(|| write_iov[0]);
        // A single range from a registered arena goes out as a fixed write (or fixed send).
        let use_fixed = fixed && fixed_index.is_some() && single.is_some();
        let entry = match (zc, single) {
            (true, Some(only)) => {
                let index = fixed_index.filter(|_| use_fixed).map(|i| i as u16);
                on_socket!(*file, fd, |socket| {
                    opcode::SendZc::new(socket, only.iov_base as *const u8, only.iov_len as u32)
                        .buf_index(index)
                        .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                        .zc_flags(SEND_ZC_REPORT_USAGE)
                        .build()
                })
            }
            (true, None) => {
                msghdr.msg_iov = write_iov.as_mut_ptr();
                msghdr.msg_iovlen = write_iov.len() as _;
                let header: *const libc::msghdr = msghdr;
                on_socket!(*file, fd, |socket| {
                    opcode::SendMsgZc::new(socket, header)
                        .ioprio(SEND_ZC_REPORT_USAGE)
                        .flags((libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32)
                        .build()
                })
            }
            (false, Some(only)) if use_fixed => on_socket!(*file, fd, |socket| {
                opcode::WriteFixed::new(
                    socket,
                    only.iov_base as *const u8,
                    only.iov_len as u32,
                    fixed_index.expect("checked") as u16,
                )
                .build()
            }),
            (false, _) => {
                let iov = write_iov.as_ptr();
                let count = write_iov.len() as u32;
                on_socket!(*file, fd, |socket| opcode::Writev::new(socket, iov, count)
                    .build())
            }
        };
        let generation = *generation;
        let (data, record) = if zc {
            let tag = self.conns[slot].as_deref().expect("present").zc_next;
            let record = ZcSend {
                slot,
                generation,
                tag,
                completed: false,
                notified: false,
            };
            let index = match self.zc_free.pop() {
                Some(index) => {
                    self.zc_sends[index] = Some(record);
                    index
                }
                None => {
                    self.zc_sends.push(Some(record));
                    self.zc_sends.len() - 1
                }
            };
            (user_data(ZC_WRITE, index, generation), Some((index, tag)))
        } else {
            (user_data(WRITE, slot, generation), None)
        };
        let entry = entry.user_data(data);
        let conn = self.conns[slot].as_deref_mut().expect("present");
        conn.connection.begin_write();
        // SAFETY: `write_iov`, `msghdr` and `staging` live in the boxed `Conn` (never moved or
        // dropped before this write's completion) and are not touched until then; `staging`
        // was reserved with STAGING bytes and never grows beyond, so no pointer into it moves.
        // The other iovecs point into segments of the network memory held by the outbound
        // queue, which keeps them (even across a failure) until `on_written`, called only
        // after the completion; those bytes are never written while leased. A zero-copy
        // send's segments are held past that, until its notification (`retain_sent` below,
        // `zc_finished`; a closed connection's move to `orphans`). A fixed write's or send's
        // range lies inside registered arena `index`. The socket (or its file slot) stays
        // open until the completions are in.
        if unsafe { self.push(&entry) } {
            self.count_socket_op(on_file);
            self.in_flight += 1;
            self.stats.writes += 1;
            self.stats.fixed_writes += u64::from(use_fixed);
            let conn = self.conns[slot].as_deref_mut().expect("present");
            conn.writing = true;
            conn.writing_after_error = conn.close_after_write;
            conn.write_len = requested;
            conn.write_data = data;
            if let Some((_, tag)) = record {
                conn.zc_next += 1;
                conn.zc_pending.push_back(tag);
                conn.connection.retain_sent(tag);
                // Its notification is awaited too (released when the completion says none
                // will come).
                self.in_flight += 1;
                self.stats.zc_sends += 1;
            }
        } else {
            // Not submitted: end the write the outbound queue was told about.
            let conn = self.conns[slot].as_deref_mut().expect("present");
            conn.connection.on_written(0);
            if let Some((index, _)) = record {
                self.free_zc_record(index);
            }
        }
    }

    fn complete(&mut self, data: u64, result: i32, flags: u32, now: Instant) {
        let (kind, slot, generation) = split_user_data(data);
        match kind {
            ZC_WRITE if cqueue::notif(flags) => self.on_zc_notification(slot, generation, result),
            ZC_WRITE => {
                let Some(record) = self.zc_record(slot, generation) else {
                    tracing::error!(slot, "io_uring: completion of an unknown zero-copy send");
                    return;
                };
                let more = cqueue::more(flags);
                record.completed = true;
                let (conn_slot, tag) = (record.slot, record.tag);
                if !more || record.notified {
                    self.free_zc_record(slot);
                }
                // The send's own completion; without `more` no notification comes either.
                self.in_flight -= 1 + usize::from(!more);
                let Some(conn) = self.slot_of(conn_slot, generation) else {
                    tracing::error!(slot, "io_uring: write completion for a gone connection");
                    return;
                };
                if !more {
                    // No notification comes: the kernel holds nothing of this send.
                    conn.zc_finished(tag);
                }
                let refused = matches!(
                    -result,
                    libc::EOPNOTSUPP | libc::EINVAL | libc::ENOMEM | libc::ENOBUFS
                );
                // Whatever `zero_copy` says now: a notification of an earlier send may have
                // switched it off while this one was in flight.
                let result = if refused {
                    // The kernel would not send this zero-copy (e.g. the locked-memory limit
                    // its pinned pages count against): plain writes from now on; the bytes go
                    // with the next one.
                    if std::mem::take(&mut conn.zero_copy) {
                        self.stats.zc_switched_off += 1;
                    }
                    if !ZC_REFUSED.swap(true, Ordering::Relaxed) {
                        tracing::info!(
                            error = %io::Error::from_raw_os_error(-result),
                            "io_uring: a zero-copy send failed; plain sends on that connection"
                        );
                    }
                    -libc::EAGAIN
                } else {
                    result
                };
                self.on_write(conn_slot, result);
            }
            ACCEPT => self.on_accept(result, now),
            WAKE => {
                self.wake_armed = false;
                self.in_flight -= 1;
                if result < 0 && !matches!(-result, libc::EINTR | libc::ECANCELED) {
                    tracing::warn!(
                        error = %io::Error::from_raw_os_error(-result),
                        "io_uring: eventfd read failed"
                    );
                }
            }
            CANCEL => {
                // The target is running and cannot be cancelled: shut the socket down so it
                // ends promptly.
                if result == -libc::EALREADY {
                    if let Some(conn) = self.slot_of(slot, generation) {
                        let _ = conn.stream.shutdown(Shutdown::Both);
                    }
                }
            }
            READ => {
                if self.slot_of(slot, generation).is_none() {
                    tracing::error!(slot, "io_uring: read completion for a gone connection");
                    return;
                }
                self.in_flight -= 1;
                self.on_read(slot, result, now);
            }
            WRITE => {
                if self.slot_of(slot, generation).is_none() {
                    tracing::error!(slot, "io_uring: write completion for a gone connection");
                    return;
                }
                self.in_flight -= 1;
                self.on_write(slot, result);
            }
            _ => unreachable!("unknown operation kind {kind}"),
        }
    }

    /// The record of zero-copy send `index` of this `generation`, if it is still live.
    fn zc_record(&mut self, index: usize, generation: u32) -> Option<&mut ZcSend> {
        self.zc_sends
            .get_mut(index)
            .and_then(Option::as_mut)
            .filter(|r| r.generation == generation)
    }

    /// Ends zero-copy send `index`'s record; the index is reused.
    fn free_zc_record(&mut self, index: usize) {
        self.zc_sends[index] = None;
        self.zc_free.push(index);
    }

    /// The kernel let go of a zero-copy send's bytes: its segments may go back to their
    /// pools (once no earlier send is unnotified). A notification reporting a copy switches
    /// zero-copy off for the connection.
    fn on_zc_notification(&mut self, index: usize, generation: u32, result: i32) {
        let Some(record) = self.zc_record(index, generation) else {
            tracing::error!(index, "io_uring: notification of an unknown zero-copy send");
            return;
        };
        record.notified = true;
        let (slot, tag) = (record.slot, record.tag);
        if record.completed {
            self.free_zc_record(index);
        }
        self.in_flight -= 1;
        self.stats.zc_notifications += 1;
        let copied = (result as u32) & NOTIF_USAGE_ZC_COPIED != 0;
        self.stats.zc_copied += u64::from(copied);
        let adaptive = self.config.zero_copy_send == crate::ZeroCopySend::Auto;
        if let Some(conn) = self.slot_of(slot, generation) {
            let switch_off = copied && conn.zero_copy && adaptive;
            if switch_off {
                conn.zero_copy = false;
                tracing::debug!(
                    peer = ?conn.connection_peer(),
                    "io_uring: the kernel copied a zero-copy send; plain sends on this \
                     connection from now on"
                );
            }
            conn.zc_finished(tag);
            self.stats.zc_switched_off += u64::from(switch_off);
            return;
        }
        // The connection closed meanwhile: its held segments wait in `orphans`.
        let Some(at) = self
            .orphans
            .iter()
            .position(|o| o.slot == slot && o.generation == generation)
        else {
            tracing::error!(slot, "io_uring: notification for an unknown connection");
            return;
        };
        let orphan = &mut self.orphans[at];
        orphan.pending.retain(|&t| t != tag);
        if orphan.pending.is_empty() {
            // Dropping the orphan returns its segments.
            self.orphans.swap_remove(at);
        }
    }

    fn slot_of(&mut self, slot: usize, generation: u32) -> Option<&mut Conn> {
        self.conns
            .get_mut(slot)?
            .as_deref_mut()
            .filter(|c| c.generation == generation)
    }

    fn on_accept(&mut self, result: i32, now: Instant) {
        self.accept_armed = false;
        self.in_flight -= 1;
        if result >= 0 {
            self.accept_failing = false;
            // SAFETY: the accept returned a new descriptor that nothing else owns.
            let stream = unsafe { TcpStream::from_raw_fd(result as RawFd) };
            if self.shutting_down {
                return;
            }
            if self.accepted >= self.config.max_connections {
                refuse_connection(&stream, false, self.accepted, self.config.max_connections);
                self.stats.refused_connections += 1;
                // Dropping the stream closes it at once.
                return;
            }
            if let Err(error) = self.config.liveness.apply(&stream) {
                tracing::debug!(%error, "socket options of an accepted connection");
            }
            let server = ServerConnection::new(self.config.server.clone(), self.manager.clone());
            self.add(stream, Side::Server(server), None);
            self.accepted += 1;
            return;
        }
        match -result {
            libc::EINTR | libc::EAGAIN | libc::ECONNABORTED | libc::ECANCELED => {}
            errno if listener_failed_for_good(errno) => {
                // Retrying would fail the same way every pause for good.
                self.stats.failed_accepts += 1;
                self.stats.listener_failed = true;
                tracing::error!(
                    error = %io::Error::from_raw_os_error(errno),
                    "the listener failed for good: no new connection is accepted (open ones go on)"
                );
            }
            errno => {
                // Out of file descriptors or memory: try again after a pause (logged once per
                // streak, not every pause).
                self.stats.failed_accepts += 1;
                let error = io::Error::from_raw_os_error(errno);
                if std::mem::replace(&mut self.accept_failing, true) {
                    tracing::debug!(%error, "accept failed again");
                } else {
                    tracing::warn!(%error, "accept failed; retrying every 10 ms");
                }
                self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
            }
        }
    }

    fn on_read(&mut self, slot: usize, result: i32, now: Instant) {
        let shutting_down = self.shutting_down;
        let conn = self.conns[slot].as_deref_mut().expect("checked");
        conn.reading = false;
        if shutting_down {
            return;
        }
        if conn.closing.is_some() {
            // Whatever arrived goes with the connection.
            self.finish_close(slot);
            return;
        }
        match result {
            0 => self.begin_close(slot, "connection closed by the peer".into()),
            n if n > 0 => {
                let destination_len = conn.read_destination_len;
                let offered: usize = conn.read_iov.iter().map(|iov| iov.iov_len).sum();
                let full = n as usize == offered;
                if let Err(error) = conn.connection.on_read(n as usize, destination_len, now) {
                    if conn.connection.was_refused_at_limit() {
                        tracing::info!(%error, "refused; the channels connect again later");
                        self.begin_close(slot, error.to_string());
                        return;
                    }
                    tracing::warn!(
                        %error,
                        peer = ?conn.connection_peer(),
                        "protocol error; closing the connection"
                    );
                    // Send the queued ErrorResponse if the socket takes it, then close.
                    conn.stop_reading = true;
                    conn.close_after_write = true;
                    conn.close_by = Some(now + super::ERROR_RESPONSE_LINGER);
                    self.stats.protocol_errors += 1;
                }
                self.reads_held += 1;
                if self.reads_held == super::READS_PER_WAKE {
                    // A long turn of reads wakes the readers of its buffers so far.
                    self.reads_held = 0;
                    crate::gate::give_held_wakes();
                }
                if full {
                    // `read_on` reads it again this turn (unless it stopped reading above).
                    self.full_reads.push(slot);
                }
            }
            _ => match -result {
                libc::EINTR | libc::EAGAIN | libc::ECANCELED => {}
                errno => self.begin_close(
                    slot,
                    format!("read failed: {}", io::Error::from_raw_os_error(errno)),
                ),
            },
        }
    }

    fn on_write(&mut self, slot: usize, result: i32) {
        let shutting_down = self.shutting_down;
        let conn = self.conns[slot].as_deref_mut().expect("checked");
        conn.writing = false;
        conn.connection.on_written(result.max(0) as usize);
        if shutting_down {
            return;
        }
        if conn.closing.is_some() {
            self.finish_close(slot);
            return;
        }
        // The write that completed may predate the error (a busy sender always has one in
        // flight): the error response queued since still gets its attempt, from `pump`.
        if conn.close_after_write && (conn.writing_after_error || !conn.connection.wants_write()) {
            self.begin_close(slot, "connection closed".into());
            return;
        }
        match result {
            0 => self.begin_close(slot, "write failed: nothing written".into()),
            n if n > 0 => {
                // The rest goes with the next write (pump).
                self.stats.short_writes += u64::from((n as usize) < conn.write_len);
            }
            _ => match -result {
                libc::EINTR | libc::EAGAIN | libc::ECANCELED => {}
                errno => self.begin_close(
                    slot,
                    format!("write failed: {}", io::Error::from_raw_os_error(errno)),
                ),
            },
        }
    }

    /// Starts closing: no new operations, those in flight are cancelled; `finish_close` ends
    /// it once they completed.
    fn begin_close(&mut self, slot: usize, reason: String) {
        let Some(conn) = self.conns[slot].as_deref_mut() else {
            return;
        };
        if conn.closing.is_some() {
            return;
        }
        conn.closing = Some(reason);
        conn.stop_reading = true;
        if let Some(peer) = conn.peer {
            if self.peers.get(&peer) == Some(&slot) {
                self.peers.remove(&peer);
            }
        }
        self.cancel(slot);
        self.finish_close(slot);
    }

    /// Asks the kernel to cancel the connection's operations in flight (once).
    fn cancel(&mut self, slot: usize) {
        let conn = self.conns[slot].as_deref_mut().expect("present");
        if conn.cancelled || conn.idle() {
            return;
        }
        let generation = conn.generation;
        let targets = [
            (conn.reading, user_data(READ, slot, generation)),
            (conn.writing, conn.write_data),
        ];
        let mut all = true;
        for (in_flight, target) in targets {
            if in_flight {
                let entry = opcode::AsyncCancel::new(target)
                    .build()
                    .user_data(user_data(CANCEL, slot, generation));
                // SAFETY: a cancellation references no memory.
                all &= unsafe { self.push(&entry) };
            }
        }
        // Not queued: `pump` tries again next turn.
        self.conns[slot].as_deref_mut().expect("present").cancelled = all;
    }

    /// Ends a closing connection once nothing is in flight: channels fail, views are released,
    /// the socket closes.
    fn finish_close(&mut self, slot: usize) {
        let ready = self.conns[slot]
            .as_deref()
            .is_some_and(|c| c.closing.is_some() && c.idle());
        if !ready {
            return;
        }
        let mut conn = self.conns[slot].take().expect("present");
        self.free_slots.push(slot);
        if conn.peer.is_none() {
            self.accepted -= 1;
        }
        let reason = conn.closing.take().unwrap_or_default();
        if conn.close_after_write {
            // A protocol error: its ErrorResponse is written; read away what the peer sent
            // meanwhile, so the close is no reset that could drop the response unread.
            super::discard_input_before_close(&conn.stream);
        }
        if let (Some(peer), false) = (conn.peer, self.shutting_down) {
            // A client connection sends no segments: nothing zero-copy is pending here.
            let unanswered = conn.connection.take_unanswered_channels();
            super::retry_unanswered(self, peer, unanswered, Instant::now());
        }
        // The channels' and views' code may panic: the segments zero-copy sends may still
        // read are put aside first all the same (unwinding would drop them back to their
        // pools under the kernel).
        let lost = panic::catch_unwind(AssertUnwindSafe(|| conn.connection.on_lost(&reason)));
        if !conn.zc_pending.is_empty() {
            // Zero-copy sends not notified yet may still read these segments (until the
            // socket lets go of its queued data): they go once the notifications are in.
            let mut held = Vec::new();
            conn.connection.take_held(&mut held);
            self.stats.zc_orphaned_connections += 1;
            let socket = conn.stream.try_clone().ok();
            if let Some(socket) = &socket {
                // The close the peer would have seen: the descriptor kept here holds the
                // socket open. Held by this process, the socket is no orphan to the kernel,
                // which would probe a peer's zero window for good: the user timeout ends it.
                let _ = socket.shutdown(Shutdown::Write);
                let _ = socket2::SockRef::from(socket).set_tcp_user_timeout(Some(ORPHAN_TIMEOUT));
            }
            self.orphans.push(Orphan {
                slot,
                generation: conn.generation,
                pending: std::mem::take(&mut conn.zc_pending),
                held,
                socket,
            });
        }
        self.unregister_file(&mut conn);
        if let Err(panic) = lost {
            panic::resume_unwind(panic);
        }
        tracing::debug!(slot, %reason, "connection closed");
        // Dropping closes the socket.
    }

    /// Shutdown gave up waiting for some connections' operations: their channels fail and
    /// their views are released all the same (a gate must not wait for good on a connection
    /// that is gone), while what the kernel may still touch stays put: a read's destination
    /// segment is taken out and leaked, frames a write may read stay in the connection (its
    /// outbound queue retires them rather than dropping them), and `Drop` leaks the
    /// connection itself.
    fn abandon_busy_connections(&mut self) {
        for conn in self.conns.iter_mut().flatten() {
            if conn.idle() && conn.zc_pending.is_empty() {
                continue;
            }
            if conn.reading {
                if let Side::Client(client) = &mut conn.connection.side {
                    std::mem::forget(client.take_payload_destination());
                }
            }
            super::for_one_at_end("failing a busy connection's channels", || {
                conn.connection.on_lost(SHUTDOWN_REASON);
            });
            // `Drop` leaks the descriptor with the connection: the peer learns of the end
            // from the reset, not from its own timeouts.
            abort_connection(&conn.stream);
        }
    }

    /// Aborts every socket whose zero-copy sends are not all notified: open connections' and
    /// orphans'.
    fn abort_unnotified_sockets(&mut self) {
        let mut count = 0;
        for conn in self.conns.iter().flatten() {
            if !conn.zc_pending.is_empty() {
                abort_connection(&conn.stream);
                count += 1;
            }
        }
        for orphan in &self.orphans {
            if let Some(socket) = &orphan.socket {
                abort_connection(socket);
                count += 1;
            }
        }
        if count > 0 {
            tracing::warn!(
                sockets = count,
                "zero-copy sends still unnotified at shutdown; aborting their connections"
            );
        }
    }

    /// Cancels everything in flight, waits (bounded) for the completions, then drops the
    /// connections (their channels fail, their views are released).
    /// Queues the cancellation of every operation in flight not cancelled yet: each
    /// connection's read and write, the accept and the eventfd read (`queued` says which of
    /// those two were queued already).
    fn cancel_everything(&mut self, queued: &mut [bool; 2]) {
        for slot in 0..self.conns.len() {
            if self.conns[slot].is_some() {
                // Does nothing for a connection cancelled already or idle.
                self.cancel(slot);
            }
        }
        let targets = [
            (self.accept_armed, user_data(ACCEPT, NO_SLOT, 0)),
            (self.wake_armed, user_data(WAKE, NO_SLOT, 0)),
        ];
        for ((armed, target), queued) in targets.into_iter().zip(queued.iter_mut()) {
            if armed && !*queued {
                let entry = opcode::AsyncCancel::new(target)
                    .build()
                    .user_data(user_data(CANCEL, NO_SLOT, 0));
                // SAFETY: a cancellation references no memory.
                *queued = unsafe { self.push(&entry) };
            }
        }
    }

    fn shutdown(&mut self) {
        self.shutting_down = true;
        // Channels still waiting for a connection fail now: none will be opened.
        self.pending.fail_all(SHUTDOWN_REASON);
        self.refused.fail_all(SHUTDOWN_REASON);
        // The accept's and the eventfd read's cancellations queued so far.
        let mut cancels_queued = [false; 2];
        let started = Instant::now();
        let deadline = started + SHUTDOWN_DRAIN;
        let mut aborted = false;
        loop {
            // Every turn: a cancellation the full submission queue refused is queued again
            // (one that was never queued leaves its operation waiting on a silent peer until
            // the drain gives up and leaks it).
            self.cancel_everything(&mut cancels_queued);
            if self.in_flight == 0 {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            if !aborted && now >= started + ZC_ABORT_GRACE {
                // Zero-copy notifications still missing after the grace: the peers stopped
                // acknowledging (host down, zero window). Their sockets would hold the
                // segments until TCP gives up, longer than the drain waits; an abort purges
                // what they queue, and the notifications come.
                aborted = true;
                self.abort_unnotified_sockets();
            }
            let mut wait = (deadline - now).min(MAX_PARK);
            if std::mem::take(&mut self.push_refused) {
                // A cancellation was refused: queued again on the next round, soon.
                self.pause_after_refusal(wait);
                wait = Duration::ZERO;
            }
            if let Err(error) = self.enter(wait) {
                tracing::error!(%error, "io_uring_enter failed during shutdown");
                break;
            }
            self.reap(Instant::now());
        }
        if self.in_flight > 0 {
            if !aborted {
                // The drain ended early (an enter failed): no peer learns of it otherwise.
                self.abort_unnotified_sockets();
            }
            tracing::error!(
                in_flight = self.in_flight,
                "io_uring operations did not complete on shutdown; leaking their memory"
            );
            self.abandon_busy_connections();
            // `Drop` leaks what is still in flight.
            return;
        }
        tracing::debug!(stats = ?self.stats, "io_uring I/O thread ends");
        // Shutdown: dropping the connections fails their channels and releases their views.
        for conn in self.conns.drain(..).flatten() {
            super::for_one_at_end("tearing down a connection", || drop(conn));
        }
    }
}

/// Aborts the TCP connection of `socket` without closing the descriptor: a connect to an
/// `AF_UNSPEC` address disconnects it, which sends a reset and frees what its queues hold
/// (zero-copy segments included, whose notifications then come).
fn abort_connection(socket: &TcpStream) {
    let address = libc::sockaddr {
        sa_family: libc::AF_UNSPEC as libc::sa_family_t,
        sa_data: [0; 14],
    };
    // SAFETY: `address` is a valid `sockaddr` of the length passed, read only during the
    // call; the descriptor is open (borrowed from `socket`).
    let result = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            &address,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if result != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), "aborting a connection failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_carries_kind_slot_and_generation() {
        for (kind, slot, generation) in [
            (ACCEPT, NO_SLOT, 0),
            (READ, 0, 1),
            (WRITE, 12345, u32::MAX),
            (CANCEL, NO_SLOT - 1, 7),
        ] {
            assert_eq!(
                split_user_data(user_data(kind, slot, generation)),
                (kind, slot, generation)
            );
        }
    }
}
