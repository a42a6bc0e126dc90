//! `fluxgate node`: one process of a cluster running a topology.
//!
//! The node starts its `ShuffleEnvironment`, learns every node's address (a rendezvous
//! directory that `fluxgate cluster` shares with its nodes, or a peers file), creates the
//! partitions of its producing subtasks and the gates of its consuming subtasks, runs every
//! subtask on its own thread, and prints one JSON line with what its subtasks sent, received
//! and found wrong. It stays up until every partition it produced was consumed (or its consumer
//! went away), so its server outlives the readers of its data.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event, StopMode};
use fluxgate::gate::{
    AlignmentMode, BufferOrEvent, CheckpointedInputGate, ConsumedSubpartition, EndOfDataStatus,
    GateError, GateItem, InputGate, OutputWait, SingleInputGate,
};
use fluxgate::io::Transport;
use fluxgate::partition::{
    ChannelSelector, KeyHashSelector, PartitionError, PartitionHandle, RecordWriter,
    ResultPartition, RoundRobinSelector, Selection,
};
use fluxgate::record::{RecordDeserializer, SpanningBudget};
use fluxgate::{ChannelDescriptor, EnvConfig, ProducerLocation, ShuffleEnvironment};
use serde::{Deserialize, Serialize};

use crate::topology::{
    make_record, max_parallelism, payload_intact, record_checksum, record_header, record_key,
    CheckpointMode, InputChannel, Partitioner, StageKind, Topology, ALIGNED_CHECKPOINT_TIMEOUT_MS,
};

/// Options of `fluxgate node`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:
  # what `fluxgate cluster` runs for node 1 of a loopback cluster
  fluxgate node --topology job.toml --index 1 --rendezvous /tmp/fluxgate-cluster-1234

  # across machines: every host gets the same topology, peers file and cluster secret
  # (peers.txt: one `host:port` per node, in index order). A node listening on a
  # non-loopback address authenticates its connections (fluxgate.security.auth = auto), so
  # it needs the secret (16 bytes or more, e.g. from `openssl rand -hex 32`): in
  # FLUXGATE_SECRET, or in a file named by \"fluxgate.security.secret-file\" in the
  # topology's [network]; without one it fails at start
  FLUXGATE_SECRET=\"$(cat cluster.secret)\" \\
    fluxgate node --topology job.toml --index 0 --peers peers.txt --bind 0.0.0.0:7000")]
pub struct NodeArgs {
    /// The topology file (the same on every node).
    #[arg(long, value_name = "FILE")]
    pub topology: PathBuf,
    /// This node's index, from 0.
    #[arg(long)]
    pub index: usize,
    /// Every node's address, one `host:port` line per node in index order (`#` comments).
    #[arg(long, value_name = "FILE", conflicts_with = "rendezvous")]
    pub peers: Option<PathBuf>,
    /// A directory shared by the nodes of a loopback cluster: each writes `node-I.addr` there,
    /// waits for the others', and leaves `node-I.progress` (updated four times a second) and
    /// `node-I.result` (and `stall` with `node-I.stall-dumped` when a consumer stalled).
    #[arg(long, value_name = "DIR")]
    pub rendezvous: Option<PathBuf>,
    /// Where to listen (default: this node's peers entry, or 127.0.0.1 on base_port + index,
    /// or on a free port).
    #[arg(long, value_name = "ADDR")]
    pub bind: Option<SocketAddr>,
    /// auto | uring | epoll (overrides `[cluster] transport`).
    #[arg(long)]
    pub transport: Option<Transport>,
    /// Seconds the node may take in all; then it reports what is stuck and exits.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// Seconds to wait for the other nodes (their addresses; with --peers, until those it
    /// exchanges data with listen), at most until --timeout runs out.
    #[arg(long, default_value_t = 30.0)]
    pub rendezvous_timeout: f64,
    /// Seconds a consuming subtask may receive nothing before it reports a stall.
    #[arg(long, default_value_t = 30.0)]
    pub stall_timeout: f64,
    /// Testing the verification: damage one record in subtask 0 of the first consuming stage.
    #[arg(long, value_enum, hide = true)]
    pub inject: Option<Fault>,
}

/// A fault to inject into one record (to test that the verification catches it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Fault {
    /// The record is not processed.
    Drop,
    /// The record is processed twice.
    Duplicate,
    /// The record is processed after the next record of its channel.
    Reorder,
    /// A byte of the record is changed.
    Corrupt,
    /// The subtask stops reading at the record until a stall was reported on any node (a
    /// test of the stall report across nodes: the consumers downstream starve).
    Hold,
    /// The buffer holding the record is never given back: its segment leaks (a test of the
    /// pool check at exit).
    Leak,
    /// The subtask's first checkpoint is handed over after the record that follows its
    /// barrier (a test of the barrier placement check).
    LateBarrier,
    /// The first barrier the subtask forwards is counted as written and never written: its
    /// consumers see that checkpoint cancelled or subsumed (a test of the per-link barrier
    /// count, which sees the barrier lost where a cancellation may be legitimate).
    LoseBarrier,
}

/// Set by a subtask that stalled: the main loop then dumps the node's connections to stderr
/// (what diagnosing a stall across nodes needs: every reader's credit, backlog and blocking).
static STALL_SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Set by the main loop once it dumped the connections for [`STALL_SEEN`].
static STALL_DUMPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Set once this node dumped its connections for a stall, its own or another node's.
static STALL_REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How long a stalled node waits for the other nodes of its cluster to dump their
/// connections before its stalled subtask fails (and starts tearing down what they show).
const PEER_DUMP_WAIT: Duration = Duration::from_secs(2);

/// Which record of the subtask's [`FAULT_CHANNEL`] a fault hits.
const FAULT_AT: u64 = 100;

/// The input channel whose record a fault hits: the first producer's link, the same one
/// whatever the timing, so that a `--kill` of another node leaves both its sides reporting.
const FAULT_CHANNEL: usize = 0;

// ---------------------------------------------------------------------------------------------
// What a node reports.

/// Records and the wrapping sum of their checksums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    /// Records.
    pub records: u64,
    /// Wrapping sum of their checksums.
    pub checksum: u64,
}

impl Tally {
    fn add(&mut self, checksum: u64) {
        self.records += 1;
        self.checksum = self.checksum.wrapping_add(checksum);
    }
}

/// A link's count marks its running checksum ([`LinkTally::prefix_marks`]) at each of its
/// first `PREFIX_MARK_EVERY` records, then every `PREFIX_MARK_EVERY` records: a short link
/// is checked to its last record, a long one in steps.
pub const PREFIX_MARK_EVERY: u64 = 256;

/// How many prefix marks a link's report holds at most: its first 196 864 records.
pub const MAX_PREFIX_MARKS: usize = 1024;

/// The records a link had carried at its prefix mark `index` (see [`PREFIX_MARK_EVERY`]).
pub fn prefix_mark_records(index: usize) -> u64 {
    let index = index as u64;
    if index < PREFIX_MARK_EVERY {
        index + 1
    } else {
        (index + 2 - PREFIX_MARK_EVERY) * PREFIX_MARK_EVERY
    }
}

/// One side's count of a link: its tally, and the tally's checksum at its prefix marks
/// ([`PREFIX_MARK_EVERY`]), so a link cut by a failure can be checked to have carried a
/// prefix of what was sent (the sums alone say only that no more arrived than was sent).
#[derive(Clone, Debug, Default)]
struct LinkCount {
    tally: Tally,
    prefix_marks: Vec<u64>,
}

impl LinkCount {
    fn add(&mut self, checksum: u64) {
        self.tally.add(checksum);
        let records = self.tally.records;
        if (records <= PREFIX_MARK_EVERY || records % PREFIX_MARK_EVERY == 0)
            && self.prefix_marks.len() < MAX_PREFIX_MARKS
        {
            self.prefix_marks.push(self.tally.checksum);
        }
    }
}

/// What went over one producer → consumer subtask pair of an edge, as one side counted it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LinkTally {
    /// The edge.
    pub edge: usize,
    /// The other side's subtask (the consumer for `sent`, the producer for `received`).
    pub peer: usize,
    /// Records.
    pub records: u64,
    /// Wrapping sum of their checksums.
    pub checksum: u64,
    /// For `received`: the channel delivered EndOfPartition (it was not cut by a failure), so
    /// its count is complete. (Absent in reports of older nodes: false.)
    #[serde(default)]
    pub ended: bool,
    /// Where the checkpoints fell in the link's records, the first [`MAX_BARRIER_MARKS`]:
    /// for `sent`, each barrier written to it; for `received`, each checkpoint handed to the
    /// consumer subtask.
    #[serde(default)]
    pub barriers: Vec<BarrierMark>,
    /// Every barrier, counted: for `sent`, those written to the link; for `received`, those
    /// its channel delivered to the consumer's barrier handler (handed to the subtask or not:
    /// late, subsumed, moved ahead of their data). A link that ended gets all it was sent.
    #[serde(default)]
    pub barrier_count: u64,
    /// The running checksum at the link's prefix marks (each of its first
    /// [`PREFIX_MARK_EVERY`] records, then every [`PREFIX_MARK_EVERY`]th), the first
    /// [`MAX_PREFIX_MARKS`]: a received link's marks must be the first of its sent marks.
    #[serde(default)]
    pub prefix_marks: Vec<u64>,
}

/// How many checkpoints a link's report places ([`LinkTally::barriers`]): enough for every
/// checkpoint of a run of several minutes, bounded for longer ones.
pub const MAX_BARRIER_MARKS: usize = 1024;

/// Where one checkpoint fell in a link's records, as one side counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BarrierMark {
    /// The checkpoint.
    pub id: u64,
    /// Sent: records the producer wrote to the link before the barrier. Received: records
    /// the consumer had read from the link when it was handed the checkpoint.
    pub records: u64,
    /// Received: the checkpoint was handed over aligned (every channel's barrier had come and
    /// held its channel), so exactly the records before each barrier were read. An unaligned
    /// one (or one whose alignment timed out) comes at the first barrier: no record from
    /// behind a barrier can have been read yet. Sent: the barrier was written aligned.
    pub aligned: bool,
}

impl BarrierMark {
    fn push_to(marks: &mut Vec<BarrierMark>, barrier: &CheckpointBarrier, records: u64) {
        if marks.len() < MAX_BARRIER_MARKS {
            marks.push(BarrierMark {
                id: barrier.id,
                records,
                aligned: barrier.alignment != Alignment::Unaligned,
            });
        }
    }
}

/// Records of one generator subtask (emitted by it, or received by a sink).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OriginTally {
    /// The generator's job-wide id.
    pub origin: u32,
    /// Records.
    pub records: u64,
    /// Wrapping sum of their checksums.
    pub checksum: u64,
}

/// One subtask's report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SubtaskReport {
    /// Stage name.
    pub stage: String,
    /// Stage index in the file.
    pub stage_index: usize,
    /// Subtask index.
    pub subtask: usize,
    /// generator | pass-through | sink.
    pub kind: String,
    /// Records read.
    pub records_in: u64,
    /// Bytes of the records read.
    pub bytes_in: u64,
    /// Records written (once per record, whatever the fan-out).
    pub records_out: u64,
    /// Records of a producer whose sequence number went back on a channel.
    pub reorders: u64,
    /// Records of a producer whose sequence number repeated on a channel.
    pub duplicates: u64,
    /// Records whose header, length or payload is not what their generator wrote.
    pub corrupt: u64,
    /// Records of a hash edge that arrived at a subtask their key does not map to.
    pub misrouted: u64,
    /// Checkpoint barriers handed to the subtask (aligned or first unaligned).
    pub checkpoints: u64,
    /// Barriers out of order (id not above the previous one).
    pub barrier_errors: u64,
    /// Checkpoints the subtask did not get to complete, the first [`MAX_BARRIER_MARKS`]:
    /// cancelled (a CancelCheckpointMarker, or an abort when a newer one came during its
    /// alignment), or subsumed (a newer one was handed over first, as an unaligned barrier
    /// overtakes an aligned one still queued; the older one's barriers are then ignored,
    /// as Flink's handler ignores them, without a word to the task).
    #[serde(default)]
    pub cancelled_checkpoints: Vec<u64>,
    /// Per checkpoint handed to the subtask, the first [`MAX_BARRIER_MARKS`]: ms from its
    /// start (the barrier's timestamp, written by the checkpointing generator) to the
    /// hand-over, on the nodes' shared wall clock. At a sink, how long the checkpoint took
    /// to cross the whole topology.
    #[serde(default)]
    pub barrier_delays_ms: Vec<u64>,
    /// A consumer of an output did not acknowledge the end of data (FLIP-147) before the
    /// subtask finished: it went away, or the wait for it ran out.
    #[serde(default)]
    pub unacknowledged_end_of_data: bool,
    /// Per output link: what this subtask wrote.
    pub sent: Vec<LinkTally>,
    /// Per input channel: what this subtask read.
    pub received: Vec<LinkTally>,
    /// Generators: what they emitted; sinks: what they received, per generator.
    pub origins: Vec<OriginTally>,
    /// Why the subtask failed.
    pub error: Option<String>,
    /// The same failure, typed: what kind, the peer it names, when it was seen.
    #[serde(default)]
    pub failure: Option<FailureReport>,
    /// Wall-clock time a subtask that did not fail finished (its partitions' ends written),
    /// ms since the Unix epoch, on the clock of `FailureReport::at_unix_ms`.
    #[serde(default)]
    pub finished_at_unix_ms: Option<u64>,
    /// The first few problems found, described.
    pub notes: Vec<String>,
}

/// What kind of error ended a subtask: the library's typed errors that a lost node causes, and
/// the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailureKind {
    /// `GateError::ConnectionLost`: the connection to a producer broke (its process died).
    ConnectionLost,
    /// `PartitionError::Released` or `GateError::ProducerFailed`: a partition written or read
    /// was released (its consumer, or its producer, went away).
    Released,
    /// A consumer received nothing for the stall timeout.
    Stalled,
    /// Anything else.
    Other,
}

impl FailureKind {
    /// How the summary names it.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::ConnectionLost => "ConnectionLost",
            FailureKind::Released => "Released",
            FailureKind::Stalled => "stalled",
            FailureKind::Other => "other error",
        }
    }
}

/// The typed form of a subtask's failure.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FailureReport {
    /// What kind of error.
    pub kind: FailureKind,
    /// The address the error names (ConnectionLost: the producer's).
    pub peer: Option<String>,
    /// Wall-clock time the subtask saw the error, ms since the Unix epoch (the launcher
    /// records its kills on the same clock, so the difference is the detection delay).
    pub at_unix_ms: u64,
}

/// The network pool when the node exits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolAtExit {
    /// Segments back in the pool.
    pub free: usize,
    /// Segments of the pool.
    pub total: usize,
}

impl PoolAtExit {
    /// Every segment came back.
    pub fn is_full(&self) -> bool {
        self.free == self.total
    }
}

/// A node's report: one JSON line on stdout (and `node-I.result` in the rendezvous dir).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NodeReport {
    /// Node index.
    pub node: usize,
    /// Where its server listened.
    pub addr: String,
    /// The driver that ran.
    pub transport: String,
    /// True when nothing failed and nothing wrong was seen.
    pub ok: bool,
    /// Wall time of the node, ms.
    pub elapsed_ms: u64,
    /// Records received per sink stage (this node's subtasks).
    pub sinks: BTreeMap<String, u64>,
    /// Reorders seen by this node's subtasks.
    pub reorders: u64,
    /// Duplicates seen by this node's subtasks.
    pub duplicates: u64,
    /// Corrupt records seen by this node's subtasks.
    pub corrupt: u64,
    /// Misrouted records seen by this node's subtasks.
    pub misrouted: u64,
    /// Checkpoint barriers out of order seen by this node's subtasks.
    pub barrier_errors: u64,
    /// What failed.
    pub errors: Vec<String>,
    /// Every subtask of the node.
    pub subtasks: Vec<SubtaskReport>,
    /// The network pool once every subtask ended and every partition was released (None:
    /// the node timed out, or an older node wrote the report).
    #[serde(default)]
    pub pool_at_exit: Option<PoolAtExit>,
}

/// What a node writes to `node-I.progress` four times a second.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct ProgressLine {
    /// Since the node started, ms.
    pub elapsed_ms: u64,
    /// Records its sinks received so far.
    pub sink_records: u64,
    /// Bytes of those records.
    pub sink_bytes: u64,
    /// Records its generators emitted so far.
    pub generated: u64,
}

#[derive(Debug, Default)]
struct Progress {
    sink_records: AtomicU64,
    sink_bytes: AtomicU64,
    generated: AtomicU64,
}

/// The rendezvous files of node `index`.
pub fn node_file(dir: &Path, index: usize, suffix: &str) -> PathBuf {
    dir.join(format!("node-{index}.{suffix}"))
}

/// The stall report across the nodes of a loopback cluster (`--rendezvous`). A stalled
/// consumer's own node shows the consumer's side of its connections (credit, floating
/// buffers); the producer's side (each reader's credit, backlog, announcements) is on the
/// nodes it reads from. So a node whose subtask stalled dumps its connections, leaves `stall`
/// (its index) in the rendezvous directory, and waits (bounded) until every other node still
/// running has answered with `node-I.stall-dumped`, each after dumping its own.
struct StallWatch<'a> {
    dir: Option<&'a Path>,
    index: usize,
    nodes: usize,
    /// This node dumped for a stall and told the others: once is enough for the cluster.
    dumped: bool,
}

impl StallWatch<'_> {
    /// Dumps `env`'s connections if a subtask of this node stalled or (once) another node
    /// reported a stall. Called from the node's wait loops.
    fn look(&mut self, env: &ShuffleEnvironment) {
        let index = self.index;
        if STALL_SEEN.swap(false, Ordering::SeqCst) {
            eprintln!(
                "node {index}: a subtask stalled; connections:\n{}",
                env.debug_dump()
            );
            if !std::mem::replace(&mut self.dumped, true) {
                if let Some(dir) = self.dir {
                    let _ = write_atomically(&dir.join("stall"), &index.to_string());
                    let _ = write_atomically(&node_file(dir, index, "stall-dumped"), "");
                    self.wait_for_peer_dumps(dir);
                }
            }
            STALL_REPORTED.store(true, Ordering::SeqCst);
            STALL_DUMPED.store(true, Ordering::SeqCst);
            return;
        }
        let Some(dir) = self.dir.filter(|_| !self.dumped) else {
            return;
        };
        if let Ok(stalled) = fs::read_to_string(dir.join("stall")) {
            eprintln!(
                "node {index}: node {} reported a stall; connections:\n{}",
                stalled.trim(),
                env.debug_dump()
            );
            let _ = write_atomically(&node_file(dir, index, "stall-dumped"), "");
            self.dumped = true;
            STALL_REPORTED.store(true, Ordering::SeqCst);
        }
    }

    /// Waits up to [`PEER_DUMP_WAIT`] for every other node's dump (a node that already wrote
    /// its result has nothing left to show).
    fn wait_for_peer_dumps(&self, dir: &Path) {
        let until = Instant::now() + PEER_DUMP_WAIT;
        let answered = |node: usize| {
            node == self.index
                || node_file(dir, node, "stall-dumped").exists()
                || node_file(dir, node, "result").exists()
        };
        // Bounded by `until`.
        while !(0..self.nodes).all(answered) && Instant::now() < until {
            thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Writes `text` to `path` through a temporary file and a rename, so readers never see half.
pub fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all().ok();
    }
    fs::rename(&tmp, path)
}

// ---------------------------------------------------------------------------------------------
// The node.

/// Runs one node; prints its report. An `Err` is a failure already reported.
pub fn run(args: &NodeArgs) -> Result<(), String> {
    let started = Instant::now();
    let result = run_node(args, started);
    let mut report = match result {
        Ok(report) => report,
        Err(error) => NodeReport {
            node: args.index,
            errors: vec![error],
            ..NodeReport::default()
        },
    };
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    report.ok = report.errors.is_empty()
        && report.reorders == 0
        && report.duplicates == 0
        && report.corrupt == 0
        && report.misrouted == 0
        && report.barrier_errors == 0;
    let line = serde_json::to_string(&report).map_err(|e| format!("report: {e}"))?;
    println!("{line}");
    if let Some(dir) = &args.rendezvous {
        let path = node_file(dir, args.index, "result");
        write_atomically(&path, &format!("{line}\n"))
            .map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
    }
    if report.ok {
        return Ok(());
    }
    let mut reasons = report.errors.clone();
    for (what, n) in [
        ("reordered", report.reorders),
        ("duplicated", report.duplicates),
        ("corrupt", report.corrupt),
        ("misrouted", report.misrouted),
    ] {
        if n > 0 {
            reasons.push(format!("{n} records {what}"));
        }
    }
    if report.barrier_errors > 0 {
        reasons.push(format!(
            "{} checkpoint barriers out of order",
            report.barrier_errors
        ));
    }
    for sub in &report.subtasks {
        for note in &sub.notes {
            reasons.push(format!("{}[{}]: {note}", sub.stage, sub.subtask));
        }
    }
    Err(format!("node {}: {}", args.index, reasons.join("; ")))
}

fn run_node(args: &NodeArgs, started: Instant) -> Result<NodeReport, String> {
    let secs = crate::cluster::secs;
    let deadline = started + secs("timeout", args.timeout)?;
    let stall = secs("stall-timeout", args.stall_timeout)?;
    let rendezvous_timeout = secs("rendezvous-timeout", args.rendezvous_timeout)?;
    let topology = Arc::new(Topology::load(&args.topology)?);
    let index = args.index;
    if index >= topology.nodes {
        return Err(format!(
            "--index {index}: the topology has {} nodes (0 to {})",
            topology.nodes,
            topology.nodes - 1
        ));
    }
    let peers = match &args.peers {
        Some(path) => Some(read_peers(path, topology.nodes)?),
        None => None,
    };
    let bind = match (args.bind, &peers) {
        (Some(bind), _) => bind,
        (None, Some(peers)) => peers[index],
        (None, None) if topology.base_port != 0 => {
            SocketAddr::from(([127, 0, 0, 1], topology.base_port + index as u16))
        }
        (None, None) => SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let mut network = topology.network.clone();
    if !topology.network_memory_given {
        // Room for every local pool at its largest, and a quarter more.
        let segments = topology.segments_needed(index);
        let segments = (segments + segments / 4 + 16).max(128);
        network.network_memory_bytes = segments * network.segment_size;
    }
    let env = ShuffleEnvironment::start(EnvConfig {
        network: network.clone(),
        bind,
        transport: args.transport.unwrap_or(topology.transport),
        node: index as u128 + 1,
        ..EnvConfig::default()
    })
    .map_err(|e| format!("cannot start the network on {bind}: {e}"))?;
    let local = env.local_addr();

    let wait = PeerWait::new(args, rendezvous_timeout, deadline);
    let addresses = match (&args.rendezvous, peers) {
        (_, Some(peers)) => {
            // The library retries a refused connection only within its request back-off
            // (`taskmanager.network.request-backoff.max`, about 20 s in all by default); hosts
            // started further apart are waited for here, up to the rendezvous timeout. Only
            // the nodes this one exchanges data with: a node with no link to it may have
            // finished and exited before this one started, while a linked one cannot have (a
            // producer stays up until its consumers read everything, a consumer until its
            // producers sent everything).
            wait_for_peers(&peers, &topology.linked_nodes(index), &wait)?;
            peers
        }
        (Some(dir), None) => rendezvous(dir, index, topology.nodes, local, &wait)?,
        (None, None) if topology.nodes == 1 => vec![local],
        (None, None) => {
            return Err(format!(
                "the topology has {} nodes: give --peers FILE (or --rendezvous DIR, as `fluxgate cluster` does)",
                topology.nodes
            ))
        }
    };

    // Partitions first, so local channels find them when the gates request them.
    let mut partitions: HashMap<(usize, usize), Vec<(usize, ResultPartition)>> = HashMap::new();
    let mut handles: Vec<PartitionHandle> = Vec::new();
    for (s, stage) in topology.stages.iter().enumerate() {
        for subtask in 0..stage.parallelism {
            if topology.node_of(s, subtask) != index {
                continue;
            }
            for &edge in &stage.outputs {
                let id = topology.partition_id(edge, subtask);
                let partition = env
                    .create_partition(id, topology.subpartitions(edge))
                    .map_err(|e| {
                        format!(
                            "{}[{subtask}]: cannot create partition {id:?}: {e}",
                            stage.name
                        )
                    })?;
                handles.push(partition.handle());
                partitions
                    .entry((s, subtask))
                    .or_default()
                    .push((edge, partition));
            }
        }
    }
    let mut gates: HashMap<(usize, usize), SingleInputGate> = HashMap::new();
    for (s, stage) in topology.stages.iter().enumerate() {
        if stage.inputs.is_empty() {
            continue;
        }
        for subtask in 0..stage.parallelism {
            if topology.node_of(s, subtask) != index {
                continue;
            }
            let descriptors: Vec<ChannelDescriptor> = topology
                .input_channels(s, subtask)
                .iter()
                .map(|c| {
                    let producer_node = topology.node_of(topology.edges[c.edge].from, c.producer);
                    ChannelDescriptor {
                        consumed: ConsumedSubpartition {
                            partition: topology.partition_id(c.edge, c.producer),
                            subpartition: c.subpartition,
                        },
                        location: if producer_node == index {
                            ProducerLocation::Local
                        } else {
                            ProducerLocation::Remote(addresses[producer_node])
                        },
                    }
                })
                .collect();
            let gate = env.create_gate(&descriptors).map_err(|e| {
                format!(
                    "{}[{subtask}]: cannot create the input gate: {e}",
                    stage.name
                )
            })?;
            gates.insert((s, subtask), gate);
        }
    }

    let progress = Arc::new(Progress::default());
    let mut running: Vec<(String, JoinHandle<SubtaskReport>)> = Vec::new();
    for (s, stage) in topology.stages.iter().enumerate() {
        for subtask in 0..stage.parallelism {
            if topology.node_of(s, subtask) != index {
                continue;
            }
            let task = Subtask {
                topology: topology.clone(),
                stage: s,
                subtask,
                partitions: partitions.remove(&(s, subtask)).unwrap_or_default(),
                gate: gates.remove(&(s, subtask)),
                progress: progress.clone(),
                stall,
                max_record_bytes: network.max_record_bytes,
                fault: args.inject,
            };
            let name = format!("{}[{subtask}]", stage.name);
            let handle = thread::Builder::new()
                .name(name.clone())
                .spawn(move || task.run())
                .map_err(|e| format!("cannot start a thread for {name}: {e}"))?;
            running.push((name, handle));
        }
    }

    // Wait for the subtasks, reporting progress four times a second.
    let progress_file = args
        .rendezvous
        .as_ref()
        .map(|d| node_file(d, index, "progress"));
    let mut next_tick = Instant::now();
    let mut timed_out = None;
    let mut stall_watch = StallWatch {
        dir: args.rendezvous.as_deref(),
        index,
        nodes: topology.nodes,
        dumped: false,
    };
    loop {
        let now = Instant::now();
        if let Some(path) = &progress_file {
            if now >= next_tick {
                next_tick = now + Duration::from_millis(250);
                let line = ProgressLine {
                    elapsed_ms: started.elapsed().as_millis() as u64,
                    sink_records: progress.sink_records.load(Ordering::Relaxed),
                    sink_bytes: progress.sink_bytes.load(Ordering::Relaxed),
                    generated: progress.generated.load(Ordering::Relaxed),
                };
                if let Ok(text) = serde_json::to_string(&line) {
                    let _ = write_atomically(path, &text);
                }
            }
        }
        stall_watch.look(&env);
        if running.iter().all(|(_, h)| h.is_finished()) {
            break;
        }
        if now >= deadline {
            let stuck: Vec<&str> = running
                .iter()
                .filter(|(_, h)| !h.is_finished())
                .map(|(name, _)| name.as_str())
                .collect();
            eprintln!(
                "node {index}: timed out; connections:\n{}",
                env.debug_dump()
            );
            timed_out = Some(format!(
                "timed out after {:.1} s with subtasks still running: {}",
                args.timeout,
                stuck.join(", ")
            ));
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }

    let mut report = NodeReport {
        node: index,
        addr: local.to_string(),
        transport: format!("{:?}", env.transport()).to_lowercase(),
        ..NodeReport::default()
    };
    report.errors.extend(timed_out.clone());
    for (name, handle) in running {
        if !handle.is_finished() {
            // Stuck (timed out): its report is lost; the process exits without it.
            continue;
        }
        let sub = match handle.join() {
            Ok(sub) => sub,
            Err(_) => {
                report.errors.push(format!("{name}: panicked"));
                continue;
            }
        };
        if let Some(error) = &sub.error {
            report.errors.push(format!("{name}: {error}"));
        }
        if sub.kind == StageKind::Sink.name() {
            *report.sinks.entry(sub.stage.clone()).or_default() += sub.records_in;
        }
        report.reorders += sub.reorders;
        report.duplicates += sub.duplicates;
        report.corrupt += sub.corrupt;
        report.misrouted += sub.misrouted;
        report.barrier_errors += sub.barrier_errors;
        report.subtasks.push(sub);
    }

    if timed_out.is_some() {
        // Threads are stuck in the library: do not wait for them (or for the I/O thread) on
        // the way out; the process exits after the report.
        std::mem::forget(env);
        return Ok(report);
    }

    // Stay up until every partition of this node was consumed or its consumer went away, so
    // remote readers get all of it before the server closes.
    while !handles.iter().all(PartitionHandle::is_released) {
        // A consumer of these partitions may stall on another node: the report wants this
        // side of its connections.
        stall_watch.look(&env);
        if Instant::now() >= deadline {
            let open: Vec<String> = handles
                .iter()
                .filter(|h| !h.is_released())
                .map(|h| format!("{:?}", h.id()))
                .collect();
            report.errors.push(format!(
                "timed out waiting for consumers of partitions {}",
                open.join(", ")
            ));
            eprintln!("node {index}: connections:\n{}", env.debug_dump());
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    if let Some(path) = &progress_file {
        let line = ProgressLine {
            elapsed_ms: started.elapsed().as_millis() as u64,
            sink_records: progress.sink_records.load(Ordering::Relaxed),
            sink_bytes: progress.sink_bytes.load(Ordering::Relaxed),
            generated: progress.generated.load(Ordering::Relaxed),
        };
        if let Ok(text) = serde_json::to_string(&line) {
            let _ = write_atomically(path, &text);
        }
    }
    report.pool_at_exit = Some(pool_at_exit(&env, deadline));
    drop(env);
    Ok(report)
}

/// How long a node waits at exit for its network pool to be full again: segments still in
/// flight on the I/O thread come back within moments; one held longer is a leak to report.
const POOL_RETURN_WAIT: Duration = Duration::from_secs(5);

/// The network pool once the last segments in flight came back (or the wait ran out).
fn pool_at_exit(env: &ShuffleEnvironment, deadline: Instant) -> PoolAtExit {
    let until = (Instant::now() + POOL_RETURN_WAIT).min(deadline);
    let pool = env.network();
    loop {
        let now = PoolAtExit {
            free: pool.available_segments(),
            total: pool.total_segments(),
        };
        if now.is_full() || Instant::now() >= until {
            return now;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

fn read_peers(path: &Path, nodes: usize) -> Result<Vec<SocketAddr>, String> {
    let text = fs::read_to_string(path)
        .map_err(|e| format!("cannot read peers file `{}`: {e}", path.display()))?;
    let mut peers = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let addr = line
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                format!(
                    "peers file `{}` line {}: `{line}` is not a host:port address",
                    path.display(),
                    number + 1
                )
            })?;
        peers.push(addr);
    }
    if peers.len() != nodes {
        return Err(format!(
            "peers file `{}` lists {} addresses, the topology has {nodes} nodes",
            path.display(),
            peers.len()
        ));
    }
    Ok(peers)
}

/// Until when a node waits for the other nodes: `--rendezvous-timeout` from the start of the
/// wait, or the node's `--timeout` deadline if that comes first (it bounds the node in all).
struct PeerWait {
    until: Instant,
    /// Which limit `until` is, for the error: "within --rendezvous-timeout (30 s)".
    limit: String,
}

impl PeerWait {
    fn new(args: &NodeArgs, rendezvous_timeout: Duration, deadline: Instant) -> Self {
        let rendezvous_until = Instant::now() + rendezvous_timeout;
        if deadline < rendezvous_until {
            PeerWait {
                until: deadline,
                limit: format!("before the node's --timeout ({} s) ran out", args.timeout),
            }
        } else {
            PeerWait {
                until: rendezvous_until,
                limit: format!(
                    "within --rendezvous-timeout ({} s)",
                    args.rendezvous_timeout
                ),
            }
        }
    }
}

/// Waits until every node of `linked` accepts connections at its `peers` address.
fn wait_for_peers(peers: &[SocketAddr], linked: &[usize], wait: &PeerWait) -> Result<(), String> {
    for &i in linked {
        let peer = &peers[i];
        // Bounded by `wait.until`.
        loop {
            let now = Instant::now();
            if now >= wait.until {
                return Err(format!(
                    "node {i} at {peer} did not accept connections {}",
                    wait.limit
                ));
            }
            let left = (wait.until - now).min(Duration::from_secs(1));
            if TcpStream::connect_timeout(peer, left).is_ok() {
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

fn rendezvous(
    dir: &Path,
    index: usize,
    nodes: usize,
    local: SocketAddr,
    wait: &PeerWait,
) -> Result<Vec<SocketAddr>, String> {
    let mine = node_file(dir, index, "addr");
    write_atomically(&mine, &local.to_string())
        .map_err(|e| format!("rendezvous: cannot write `{}`: {e}", mine.display()))?;
    let mut addresses: Vec<Option<SocketAddr>> = vec![None; nodes];
    loop {
        for (i, slot) in addresses.iter_mut().enumerate() {
            if slot.is_some() {
                continue;
            }
            let path = node_file(dir, i, "addr");
            if node_file(dir, i, "result").exists() && !path.exists() {
                return Err(format!(
                    "rendezvous: node {i} failed before reporting its address"
                ));
            }
            if let Ok(text) = fs::read_to_string(&path) {
                let addr = text
                    .trim()
                    .parse()
                    .map_err(|_| format!("rendezvous: `{}` holds no address", path.display()))?;
                *slot = Some(addr);
            }
        }
        if addresses.iter().all(Option::is_some) {
            return Ok(addresses.into_iter().flatten().collect());
        }
        if Instant::now() >= wait.until {
            let missing: Vec<String> = addresses
                .iter()
                .enumerate()
                .filter(|(_, a)| a.is_none())
                .map(|(i, _)| i.to_string())
                .collect();
            return Err(format!(
                "rendezvous: node(s) {} did not report an address {}",
                missing.join(", "),
                wait.limit
            ));
        }
        thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------------
// Subtasks.

/// Everything a subtask thread owns.
struct Subtask {
    topology: Arc<Topology>,
    stage: usize,
    subtask: usize,
    partitions: Vec<(usize, ResultPartition)>,
    gate: Option<SingleInputGate>,
    progress: Arc<Progress>,
    stall: Duration,
    max_record_bytes: usize,
    fault: Option<Fault>,
}

/// How many problems a subtask describes in words.
const MAX_NOTES: usize = 5;

impl Subtask {
    fn run(self) -> SubtaskReport {
        let stage = &self.topology.stages[self.stage];
        let mut report = SubtaskReport {
            stage: stage.name.clone(),
            stage_index: self.stage,
            subtask: self.subtask,
            kind: stage.kind.name().to_string(),
            ..SubtaskReport::default()
        };
        let Subtask {
            topology,
            stage: s,
            subtask,
            partitions,
            gate,
            progress,
            stall,
            max_record_bytes,
            fault,
        } = self;
        let mut outputs: Vec<Output> = partitions
            .into_iter()
            .map(|(edge, partition)| Output::new(&topology, edge, subtask, partition))
            .collect();
        let result = match (topology.stages[s].kind, gate) {
            (StageKind::Generator, _) => {
                generate(&topology, s, subtask, &mut outputs, &progress, &mut report)
            }
            (_, Some(gate)) => {
                let mut consumer = Consumer::new(&topology, s, subtask, &progress);
                // Faults go into subtask 0 of the first consuming stage only.
                let first_consumer = topology
                    .order
                    .iter()
                    .copied()
                    .find(|&t| topology.stages[t].kind != StageKind::Generator);
                let fault = fault.filter(|_| subtask == 0 && first_consumer == Some(s));
                let result = consume(
                    gate,
                    &topology,
                    stall,
                    max_record_bytes,
                    &mut consumer,
                    &mut outputs,
                    fault,
                );
                consumer.finish(&mut report);
                result
            }
            (_, None) => Err(Failed::from("no input gate".to_string())),
        };
        let result = result.and_then(|()| {
            end_of_data(&mut outputs, stall, &mut report)?;
            outputs.iter_mut().try_for_each(|o| {
                o.writer
                    .finish()
                    .map_err(|e| Failed::writing(&e, format!("finishing: {e}")))
            })
        });
        if result.is_ok() {
            report.finished_at_unix_ms = Some(unix_millis());
        }
        if let Err(failed) = result {
            if failed.consumer_gone {
                wait_for_other_consumers(&mut outputs);
            }
            // Consumers of our partitions learn at once instead of waiting for a stall.
            for output in &mut outputs {
                output.writer.partition_mut().release();
            }
            report.failure = Some(failed.report());
            report.error = Some(failed.message);
        }
        for output in &outputs {
            for (i, count) in output.tallies.iter().enumerate() {
                report.sent.push(LinkTally {
                    edge: output.edge,
                    peer: output.targets[i],
                    records: count.tally.records,
                    checksum: count.tally.checksum,
                    ended: false,
                    barriers: output.barrier_marks[i].clone(),
                    barrier_count: output.barriers_written,
                    prefix_marks: count.prefix_marks.clone(),
                });
            }
        }
        report
    }
}

/// How long a producer that lost a consumer waits for its other consumers to go as well before
/// it releases its partitions. Those that read from the lost node too fail on their own within
/// moments, with the error that names the lost peer; releasing at once would race that error
/// with a `Released` of ours (the failure spreading through this producer). Consumers still
/// reading after the wait are released: the job's region failed, as Flink fails it.
const ORPHAN_GRACE: Duration = Duration::from_secs(3);

/// After a consumer went away: flush what was written (a consumer that stays gets it) and wait,
/// up to [`ORPHAN_GRACE`], until every partition was released by its consumers.
fn wait_for_other_consumers(outputs: &mut [Output]) {
    let handles: Vec<PartitionHandle> = outputs
        .iter_mut()
        .map(|o| {
            o.writer.flush_all();
            o.writer.partition().handle()
        })
        .collect();
    let until = Instant::now() + ORPHAN_GRACE;
    while Instant::now() < until && !handles.iter().all(PartitionHandle::is_released) {
        thread::sleep(Duration::from_millis(5));
    }
}

/// Why a subtask stopped: the report's message and its typed form.
#[derive(Debug)]
struct Failed {
    message: String,
    kind: FailureKind,
    peer: Option<SocketAddr>,
    at_unix_ms: u64,
    /// A partition of ours was released by its consumer (not by us, not upstream).
    consumer_gone: bool,
}

impl Failed {
    fn new(kind: FailureKind, peer: Option<SocketAddr>, message: String) -> Self {
        Self {
            message,
            kind,
            peer,
            at_unix_ms: unix_millis(),
            consumer_gone: false,
        }
    }

    /// Writing to one of our partitions failed.
    fn writing(error: &PartitionError, message: String) -> Self {
        match error {
            PartitionError::Released => Self {
                consumer_gone: true,
                ..Self::new(FailureKind::Released, None, message)
            },
            _ => Self::new(FailureKind::Other, None, message),
        }
    }

    /// Reading the input gate failed.
    fn reading(error: GateError) -> Self {
        let (kind, peer) = match &error {
            GateError::ConnectionLost { peer, .. } => (FailureKind::ConnectionLost, Some(*peer)),
            GateError::Partition {
                source: PartitionError::Released,
                ..
            }
            | GateError::ProducerFailed { .. } => (FailureKind::Released, None),
            _ => (FailureKind::Other, None),
        };
        Self::new(kind, peer, format!("input gate failed: {error}"))
    }

    fn report(&self) -> FailureReport {
        FailureReport {
            kind: self.kind,
            peer: self.peer.map(|p| p.to_string()),
            at_unix_ms: self.at_unix_ms,
        }
    }
}

impl From<String> for Failed {
    fn from(message: String) -> Self {
        Self::new(FailureKind::Other, None, message)
    }
}

/// The writer of one output edge, counting what goes to each consumer subtask.
struct Output {
    edge: usize,
    targets: Vec<usize>,
    writer: RecordWriter<Tap>,
    /// Where the records of the last `emit` or `emit_batch` went, in order.
    chosen: Rc<RefCell<Vec<Selection>>>,
    tallies: Vec<LinkCount>,
    /// Per channel: where each barrier written fell in its records.
    barrier_marks: Vec<Vec<BarrierMark>>,
    /// Barriers written (to every channel: they are broadcast).
    barriers_written: u64,
}

impl AsMut<ResultPartition> for Output {
    fn as_mut(&mut self) -> &mut ResultPartition {
        self.writer.partition_mut()
    }
}

impl Output {
    fn new(topology: &Topology, edge: usize, producer: usize, partition: ResultPartition) -> Self {
        let chosen = Rc::new(RefCell::new(Vec::with_capacity(GENERATOR_BATCH)));
        let channels = topology.subpartitions(edge);
        let e = &topology.edges[edge];
        let tap = Tap {
            partitioner: e.partitioner,
            round_robin: RoundRobinSelector::starting_at(producer % channels),
            hash: KeyHashSelector::new(
                record_key as fn(&[u8]) -> u64,
                max_parallelism(topology.stages[e.to].parallelism),
            ),
            chosen: chosen.clone(),
        };
        let timeout = topology.buffer_timeout(edge, producer);
        Self {
            edge,
            targets: topology.targets(edge, producer),
            writer: RecordWriter::new(partition, tap, timeout),
            chosen,
            tallies: vec![LinkCount::default(); channels],
            barrier_marks: vec![Vec::new(); channels],
            barriers_written: 0,
        }
    }

    fn emit(&mut self, record: &[u8], checksum: u64) -> Result<(), Failed> {
        self.chosen.borrow_mut().clear();
        self.writer
            .emit(record)
            .map_err(|e| Failed::writing(&e, format!("writing to edge {}: {e}", self.edge)))?;
        self.count_chosen(&[checksum], 1);
        Ok(())
    }

    /// `records` through one `emit_all`, each with its checksum in `checksums`; returns how
    /// many were written, with the error if one stopped the batch. On an error the records
    /// before the refused one (the last the selector saw) were written, and are counted, as
    /// one `emit` each would have counted them.
    fn emit_batch(
        &mut self,
        records: &[Vec<u8>],
        checksums: &[u64],
    ) -> (usize, Result<(), Failed>) {
        self.chosen.borrow_mut().clear();
        let written = self.writer.emit_all(records.iter().map(Vec::as_slice));
        let selected = self.chosen.borrow().len();
        let counted = if written.is_ok() {
            selected
        } else {
            selected.saturating_sub(1)
        };
        self.count_chosen(checksums, counted);
        let written =
            written.map_err(|e| Failed::writing(&e, format!("writing to edge {}: {e}", self.edge)));
        (counted, written)
    }

    /// Adds the first `records` of the records the selector chose channels for to their
    /// channels' tallies.
    fn count_chosen(&mut self, checksums: &[u64], records: usize) {
        for (selection, &checksum) in self.chosen.borrow().iter().zip(checksums).take(records) {
            match *selection {
                Selection::Channel(i) => self.tallies[i].add(checksum),
                Selection::Broadcast => self.tallies.iter_mut().for_each(|t| t.add(checksum)),
            }
        }
    }

    fn barrier(&mut self, barrier: CheckpointBarrier) -> Result<(), Failed> {
        let priority = barrier.alignment == Alignment::Unaligned;
        self.writer
            .broadcast_event(&Event::CheckpointBarrier(barrier), priority)
            .map_err(|e| {
                Failed::writing(&e, format!("writing a barrier to edge {}: {e}", self.edge))
            })?;
        self.barriers_written += 1;
        for (count, marks) in self.tallies.iter().zip(&mut self.barrier_marks) {
            BarrierMark::push_to(marks, &barrier, count.tally.records);
        }
        Ok(())
    }

    /// Passes on the cancellation of checkpoint `id`, as Flink's task does when its barrier
    /// handler aborts one: consumers aligning it stop waiting for its barriers.
    fn cancel_checkpoint(&mut self, id: u64) -> Result<(), Failed> {
        self.writer
            .broadcast_event(&Event::CancelCheckpointMarker(id), false)
            .map_err(|e| {
                Failed::writing(
                    &e,
                    format!("writing a cancellation marker to edge {}: {e}", self.edge),
                )
            })
    }
}

/// The edge's partitioner, remembering where each record of the last `emit` or `emit_batch`
/// went.
struct Tap {
    partitioner: Partitioner,
    round_robin: RoundRobinSelector,
    hash: KeyHashSelector<fn(&[u8]) -> u64>,
    chosen: Rc<RefCell<Vec<Selection>>>,
}

impl ChannelSelector<[u8]> for Tap {
    fn select(&mut self, record: &[u8], channels: usize) -> Selection {
        let selection = match self.partitioner {
            Partitioner::Forward => Selection::Channel(0),
            Partitioner::Rebalance => self.round_robin.select(record, channels),
            Partitioner::Hash => self.hash.select(record, channels),
            Partitioner::Broadcast => Selection::Broadcast,
        };
        self.chosen.borrow_mut().push(selection);
        selection
    }
}

/// Milliseconds since the Unix epoch (kill records, barrier timestamps).
pub(crate) fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn barrier_for(mode: CheckpointMode, id: u64) -> CheckpointBarrier {
    let alignment = match mode {
        CheckpointMode::Aligned => Alignment::Aligned,
        CheckpointMode::Unaligned => Alignment::Unaligned,
        CheckpointMode::Mixed if id % 2 == 0 => Alignment::Unaligned,
        CheckpointMode::Mixed => Alignment::Aligned,
        CheckpointMode::AlignedTimeout => Alignment::AlignedWithTimeout {
            timeout_ms: ALIGNED_CHECKPOINT_TIMEOUT_MS,
        },
    };
    CheckpointBarrier {
        id,
        timestamp: unix_millis() as i64,
        kind: CheckpointKind::Checkpoint,
        alignment,
    }
}

/// Records a generator subtask that emits in batches hands each output per `emit_all`; also
/// how often every generator looks at the clock for its end and its checkpoints.
const GENERATOR_BATCH: usize = 16;

fn generate(
    topology: &Topology,
    stage: usize,
    subtask: usize,
    outputs: &mut [Output],
    progress: &Progress,
    report: &mut SubtaskReport,
) -> Result<(), Failed> {
    let generator = topology.stages[stage]
        .generator
        .expect("a generator stage has generator settings");
    let origin = topology.origin(stage, subtask);
    let start = Instant::now();
    let end = generator.duration.map(|d| start + d);
    let limit = generator.records.unwrap_or(u64::MAX);
    let mut next_checkpoint = topology
        .checkpoints
        .map(|c| (1u64, start + c.interval, c.interval, c.mode));
    let mut emitted = Tally::default();
    // Even subtasks hand their outputs GENERATOR_BATCH records per `emit_all` (its runs in
    // up to 16 subpartitions at once), odd ones one record per `emit`: a generator stage of
    // two subtasks or more checks both paths end to end.
    let batch = if subtask % 2 == 0 { GENERATOR_BATCH } else { 1 };
    let mut records: Vec<Vec<u8>> = (0..batch)
        .map(|_| Vec::with_capacity(generator.max_size))
        .collect();
    let mut checksums = [0u64; GENERATOR_BATCH];
    let mut unreported = 0u64;
    let mut result = Ok(());
    let mut seq = 0u64;
    while seq < limit {
        // Every GENERATOR_BATCH records, whichever way they go out: the barriers fall where
        // they fell when every subtask emitted record by record.
        if seq % GENERATOR_BATCH as u64 == 0 && (end.is_some() || next_checkpoint.is_some()) {
            let now = Instant::now();
            if end.is_some_and(|end| now >= end) {
                break;
            }
            if let Some((id, due, interval, mode)) = next_checkpoint.as_mut() {
                if now >= *due {
                    let barrier = barrier_for(*mode, *id);
                    if let Err(e) = outputs.iter_mut().try_for_each(|o| o.barrier(barrier)) {
                        result = Err(e);
                        break;
                    }
                    *id += 1;
                    *due = (*due + *interval).max(now);
                }
            }
        }
        // Up to the next multiple of GENERATOR_BATCH (or the limit), so a batch never
        // crosses a barrier's place.
        let count = (batch as u64)
            .min(limit - seq)
            .min(GENERATOR_BATCH as u64 - seq % GENERATOR_BATCH as u64)
            as usize;
        for (i, record) in records.iter_mut().take(count).enumerate() {
            make_record(&generator, origin, seq + i as u64, record);
            checksums[i] = record_checksum(record);
        }
        // The records that went out to at least one output count as emitted, also when an
        // output refused one: sinks may then receive fewer than the tally says, never more.
        let mut reached = 0;
        let mut written = Ok(());
        for output in outputs.iter_mut() {
            let (counted, result) = if batch == 1 {
                match output.emit(&records[0], checksums[0]) {
                    Ok(()) => (1, Ok(())),
                    Err(e) => (0, Err(e)),
                }
            } else {
                output.emit_batch(&records[..count], &checksums[..count])
            };
            reached = reached.max(counted);
            if result.is_err() {
                written = result;
                break;
            }
        }
        for &checksum in &checksums[..reached] {
            emitted.add(checksum);
        }
        seq += reached as u64;
        unreported += reached as u64;
        if let Err(e) = written {
            result = Err(e);
            break;
        }
        if unreported >= 32 {
            progress.generated.fetch_add(unreported, Ordering::Relaxed);
            unreported = 0;
        }
    }
    progress.generated.fetch_add(unreported, Ordering::Relaxed);
    report.records_out = emitted.records;
    report.origins.push(OriginTally {
        origin,
        records: emitted.records,
        checksum: emitted.checksum,
    });
    result
}

/// Per input channel: what came and what is checked.
struct ChannelCheck {
    channel: InputChannel,
    from_stage: usize,
    count: LinkCount,
    hash: bool,
    /// EndOfPartition arrived: the tally is complete.
    ended: bool,
    /// Where each checkpoint handed over fell in this channel's records.
    barrier_marks: Vec<BarrierMark>,
    /// Barriers the channel delivered to the barrier handler (read off the gate at a clean
    /// end; 0 in the report of a subtask that failed).
    barriers_received: u64,
}

/// The verifying state of a pass-through or sink subtask.
struct Consumer<'a> {
    topology: &'a Topology,
    stage: usize,
    subtask: usize,
    sink: bool,
    channels: Vec<ChannelCheck>,
    /// Last sequence number per (channel, producer id), where order is guaranteed.
    last: HashMap<u64, u64>,
    origins: HashMap<u32, Tally>,
    hash: KeyHashSelector<fn(&[u8]) -> u64>,
    records_in: u64,
    bytes_in: u64,
    records_out: u64,
    reorders: u64,
    duplicates: u64,
    corrupt: u64,
    misrouted: u64,
    checkpoints: u64,
    last_checkpoint: u64,
    barrier_errors: u64,
    cancelled_checkpoints: Vec<u64>,
    barrier_delays_ms: Vec<u64>,
    notes: Vec<String>,
    delay: Duration,
    owed: Duration,
    progress: &'a Progress,
    unreported: (u64, u64),
}

impl<'a> Consumer<'a> {
    fn new(topology: &'a Topology, stage: usize, subtask: usize, progress: &'a Progress) -> Self {
        let channels = topology
            .input_channels(stage, subtask)
            .into_iter()
            .map(|channel| ChannelCheck {
                channel,
                from_stage: topology.edges[channel.edge].from,
                count: LinkCount::default(),
                hash: topology.edges[channel.edge].partitioner == Partitioner::Hash,
                ended: false,
                barrier_marks: Vec::new(),
                barriers_received: 0,
            })
            .collect();
        let parallelism = topology.stages[stage].parallelism;
        Self {
            topology,
            stage,
            subtask,
            sink: topology.stages[stage].kind == StageKind::Sink,
            channels,
            last: HashMap::new(),
            origins: HashMap::new(),
            hash: KeyHashSelector::new(
                record_key as fn(&[u8]) -> u64,
                max_parallelism(parallelism),
            ),
            records_in: 0,
            bytes_in: 0,
            records_out: 0,
            reorders: 0,
            duplicates: 0,
            corrupt: 0,
            misrouted: 0,
            checkpoints: 0,
            last_checkpoint: 0,
            barrier_errors: 0,
            cancelled_checkpoints: Vec::new(),
            barrier_delays_ms: Vec::new(),
            notes: Vec::new(),
            delay: topology.stages[stage].delay_of(subtask),
            owed: Duration::ZERO,
            progress,
            unreported: (0, 0),
        }
    }

    fn note(&mut self, text: impl FnOnce() -> String) {
        if self.notes.len() < MAX_NOTES {
            self.notes.push(text());
        }
    }

    /// Checks one record; returns its checksum.
    fn record(&mut self, channel: usize, bytes: &[u8]) -> u64 {
        self.records_in += 1;
        self.bytes_in += bytes.len() as u64;
        let checksum = record_checksum(bytes);
        let check = &mut self.channels[channel];
        check.count.add(checksum);
        let (producer, from_stage, hash) = (check.channel.producer, check.from_stage, check.hash);
        let Some((origin, seq)) = record_header(bytes) else {
            self.corrupt += 1;
            self.note(|| {
                format!(
                    "channel {channel}: a record of {} bytes has no header",
                    bytes.len()
                )
            });
            return checksum;
        };
        if self.topology.in_order(from_stage, producer, origin) {
            let key = (channel as u64) << 32 | u64::from(origin);
            let previous = self.last.get(&key).copied();
            match previous {
                Some(previous) if seq == previous => {
                    self.duplicates += 1;
                    self.note(|| {
                        format!("channel {channel}: producer {origin} sequence {seq} twice")
                    });
                }
                Some(previous) if seq < previous => {
                    self.reorders += 1;
                    self.note(|| {
                        format!(
                            "channel {channel}: producer {origin} sequence {seq} after {previous}"
                        )
                    });
                }
                _ => {
                    self.last.insert(key, seq);
                }
            }
        }
        if hash {
            let channels = self.topology.stages[self.stage].parallelism;
            if self.hash.select(bytes, channels) != Selection::Channel(self.subtask) {
                self.misrouted += 1;
                self.note(|| {
                    format!("channel {channel}: producer {origin} sequence {seq} hashed elsewhere")
                });
            }
        }
        if self.sink {
            let intact = self.topology.record_len(origin, seq) == Some(bytes.len())
                && payload_intact(bytes, origin, seq);
            if !intact {
                self.corrupt += 1;
                self.note(|| {
                    format!(
                        "channel {channel}: producer {origin} sequence {seq}: {} bytes, not what the generator wrote",
                        bytes.len()
                    )
                });
            }
            self.origins.entry(origin).or_default().add(checksum);
            self.unreported.0 += 1;
            self.unreported.1 += bytes.len() as u64;
            if self.unreported.0 >= 32 || self.unreported.1 >= 1 << 20 {
                self.flush_progress();
            }
        }
        if !self.delay.is_zero() {
            self.owed += self.delay;
            if self.owed >= Duration::from_millis(1) {
                thread::sleep(self.owed);
                self.owed = Duration::ZERO;
            }
        }
        checksum
    }

    fn flush_progress(&mut self) {
        let (records, bytes) = std::mem::take(&mut self.unreported);
        self.progress
            .sink_records
            .fetch_add(records, Ordering::Relaxed);
        self.progress.sink_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn barrier(&mut self, barrier: &CheckpointBarrier) {
        if barrier.id <= self.last_checkpoint {
            self.barrier_errors += 1;
            let last = self.last_checkpoint;
            self.note(|| format!("checkpoint {} handed over after {last}", barrier.id));
        } else {
            // Bounded by the cap: ids grow by one per checkpoint interval.
            for subsumed in self.last_checkpoint + 1..barrier.id {
                if self.cancelled_checkpoints.len() >= MAX_BARRIER_MARKS {
                    break;
                }
                if !self.cancelled_checkpoints.contains(&subsumed) {
                    self.cancelled_checkpoints.push(subsumed);
                }
            }
            self.last_checkpoint = barrier.id;
        }
        self.checkpoints += 1;
        if self.barrier_delays_ms.len() < MAX_BARRIER_MARKS {
            let started = u64::try_from(barrier.timestamp).unwrap_or(0);
            self.barrier_delays_ms
                .push(unix_millis().saturating_sub(started));
        }
        for channel in &mut self.channels {
            BarrierMark::push_to(
                &mut channel.barrier_marks,
                barrier,
                channel.count.tally.records,
            );
        }
    }

    fn cancelled(&mut self, id: u64) {
        if self.cancelled_checkpoints.len() < MAX_BARRIER_MARKS {
            self.cancelled_checkpoints.push(id);
        }
    }

    fn finish(mut self, report: &mut SubtaskReport) {
        self.flush_progress();
        report.records_in = self.records_in;
        report.bytes_in = self.bytes_in;
        report.records_out = self.records_out;
        report.reorders = self.reorders;
        report.duplicates = self.duplicates;
        report.corrupt = self.corrupt;
        report.misrouted = self.misrouted;
        report.checkpoints = self.checkpoints;
        report.barrier_errors = self.barrier_errors;
        report.cancelled_checkpoints = self.cancelled_checkpoints;
        report.barrier_delays_ms = self.barrier_delays_ms;
        report.received = self
            .channels
            .into_iter()
            .map(|c| LinkTally {
                edge: c.channel.edge,
                peer: c.channel.producer,
                records: c.count.tally.records,
                checksum: c.count.tally.checksum,
                ended: c.ended,
                barriers: c.barrier_marks,
                barrier_count: c.barriers_received,
                prefix_marks: c.count.prefix_marks,
            })
            .collect();
        let mut origins: Vec<OriginTally> = self
            .origins
            .iter()
            .map(|(&origin, t)| OriginTally {
                origin,
                records: t.records,
                checksum: t.checksum,
            })
            .collect();
        origins.sort_by_key(|o| o.origin);
        report.origins = origins;
        report.notes = self.notes;
    }
}

/// The next record of `channel`'s buffer. A channel refused memory for a record spanning
/// buffers first takes back what the others keep from records already read, as a
/// `RecordReader` does: only records assembled at once count against the budget.
fn next_record_of(
    deserializers: &mut [RecordDeserializer],
    channel: usize,
) -> Result<Option<&[u8]>, String> {
    let found = RecordDeserializer::advance_among(deserializers, channel)
        .map_err(|e| format!("channel {channel}: {e}"))?;
    Ok(found.then(|| deserializers[channel].current_record()))
}

/// `--inject hold`: keeps the subtask from reading until a node reported a stall (bounded by
/// a few stall timeouts), then fails it.
fn hold_until_a_stall_is_reported(stall: Duration) -> Failed {
    let until = Instant::now() + stall * 3 + Duration::from_secs(10);
    // Bounded by `until`.
    while !STALL_REPORTED.load(Ordering::SeqCst) && Instant::now() < until {
        thread::sleep(Duration::from_millis(10));
    }
    Failed::new(
        FailureKind::Other,
        None,
        "held by --inject hold until a stall was reported".into(),
    )
}

/// Reads a gate to its end (barriers aligned as the topology says), checking every record and
/// forwarding records and barriers to `outputs` (none for a sink).
fn consume(
    gate: SingleInputGate,
    topology: &Topology,
    stall: Duration,
    max_record_bytes: usize,
    consumer: &mut Consumer<'_>,
    outputs: &mut [Output],
    fault: Option<Fault>,
) -> Result<(), Failed> {
    let mode = match topology.checkpoints.map(|c| c.mode) {
        Some(
            CheckpointMode::Unaligned | CheckpointMode::Mixed | CheckpointMode::AlignedTimeout,
        ) => AlignmentMode::Unaligned,
        _ => AlignmentMode::Aligned,
    };
    let channels = gate.channel_count();
    let mut gate = CheckpointedInputGate::new(gate, mode, None);
    // The subtask's channels share the memory they may hold for records spanning buffers,
    // as a `RecordReader`'s do.
    let budget = SpanningBudget::new(SpanningBudget::default_limit(max_record_bytes));
    let mut deserializers: Vec<RecordDeserializer> = (0..channels)
        .map(|_| RecordDeserializer::new(max_record_bytes).with_budget(budget.clone()))
        .collect();
    // Fault injection (hidden `--inject`): the record FAULT_AT of this subtask's channel
    // FAULT_CHANNEL.
    let mut injected = Injected {
        fault,
        ..Injected::default()
    };
    let mut seen = 0u64;
    let mut leaked = false;
    loop {
        // Past every channel's EndOfData only the ends are to come, after the producers heard
        // every consumer's acknowledgement (see `end_of_data`): not a stall.
        let quiet = match gate.end_of_data_status() {
            EndOfDataStatus::NotEndOfData => stall,
            _ => stall * (END_OF_DATA_STALLS + 1),
        };
        let item = match gate.next_until(Some(Instant::now() + quiet)) {
            Ok(Some(item)) => item,
            Ok(None) => break,
            Err(GateError::TimedOut) => {
                let open: Vec<String> = (0..channels)
                    .filter(|&c| !consumer.channels[c].ended)
                    .map(|c| c.to_string())
                    .collect();
                // The node's main loop dumps its connections (the producer side of this
                // node's partitions) once it sees this; wait (bounded) for that dump, so it
                // shows the state of the stall, not of the failure handling that follows.
                STALL_DUMPED.store(false, Ordering::SeqCst);
                STALL_SEEN.store(true, Ordering::SeqCst);
                let asked = Instant::now();
                while !STALL_DUMPED.load(Ordering::SeqCst)
                    && asked.elapsed() < Duration::from_secs(2)
                {
                    thread::sleep(Duration::from_millis(5));
                }
                return Err(Failed::new(
                    FailureKind::Stalled,
                    None,
                    format!(
                        "nothing received for {:.0} s (stalled); channels not ended: {}; gate: {}; alignment: {:?}",
                        quiet.as_secs_f64(),
                        open.join(", "),
                        gate.gate().debug_summary(),
                        gate
                    ),
                ));
            }
            Err(e) => return Err(Failed::reading(e)),
        };
        let channel = item.channel;
        match item.item {
            GateItem::Buffer(buffer) => {
                if fault == Some(Fault::Leak) && !leaked {
                    // The segment of the subtask's first buffer, never given back.
                    std::mem::forget(buffer.clone());
                    leaked = true;
                }
                deserializers[channel]
                    .set_next_buffer(buffer)
                    .map_err(|e| format!("channel {channel}: {e}"))?;
                loop {
                    // Not for a buffer read to its end: the read below lets it go, and the
                    // next buffer's first record waits instead.
                    if deserializers[channel].has_partial_record() {
                        before_record(
                            &mut gate,
                            consumer,
                            outputs,
                            &mut deserializers,
                            &mut injected,
                        )?;
                    }
                    let Some(record) = next_record_of(&mut deserializers, channel)? else {
                        break;
                    };
                    seen += u64::from(channel == FAULT_CHANNEL);
                    match fault.filter(|_| channel == FAULT_CHANNEL && seen == FAULT_AT) {
                        None => {}
                        Some(Fault::Drop) => continue,
                        Some(Fault::Duplicate) => handle(consumer, outputs, channel, record)?,
                        Some(Fault::Reorder) => {
                            injected.held = Some((channel, record.to_vec()));
                            continue;
                        }
                        Some(Fault::Hold) => return Err(hold_until_a_stall_is_reported(stall)),
                        Some(Fault::Leak | Fault::LateBarrier | Fault::LoseBarrier) => {}
                        Some(Fault::Corrupt) => {
                            let mut copy = record.to_vec();
                            let last = copy.len() - 1;
                            copy[last] ^= 0x5A;
                            handle(consumer, outputs, channel, &copy)?;
                            continue;
                        }
                    }
                    handle(consumer, outputs, channel, record)?;
                    injected.release_held(consumer, outputs, channel)?;
                    if let Some(barrier) = injected.late_barrier.take() {
                        hand_over(consumer, outputs, &barrier)?;
                    }
                }
            }
            GateItem::Event { event, .. } => {
                injected.on_event(consumer, outputs, &mut deserializers, channel, event)?;
            }
        }
    }
    for (index, channel) in consumer.channels.iter_mut().enumerate() {
        channel.barriers_received = gate.barriers_received(index);
    }
    if let Some(channel) = consumer.channels.iter().position(|c| !c.ended) {
        return Err(Failed::from(format!(
            "the gate ended without EndOfPartition on channel {channel}"
        )));
    }
    gate.gate_mut().close();
    Ok(())
}

/// Before each record, as Flink's task runs its mailbox between records: the priority events
/// queued (an unaligned barrier triggers its checkpoint here, mid-buffer, not after the
/// buffer's last record), then, while an output is back-pressured, no input but priority
/// events: the task waits for room, taking unaligned barriers as they come instead of
/// blocking in a record's write until the consumer downstream frees a buffer. The outputs are
/// waited for together (`wait_for_outputs`): the task reads on only from a look at which every
/// output takes records, as an event handled meanwhile may have filled one again.
fn before_record<G: InputGate>(
    gate: &mut CheckpointedInputGate<G>,
    consumer: &mut Consumer<'_>,
    outputs: &mut [Output],
    deserializers: &mut [RecordDeserializer],
    injected: &mut Injected,
) -> Result<(), Failed> {
    // Bounded by the priority events queued.
    while gate.has_priority_event() {
        let Some(item) = gate.poll_priority().map_err(Failed::reading)? else {
            break;
        };
        injected.on_priority_item(consumer, outputs, deserializers, item)?;
    }
    // Each round ends at an event handled or with room in every output at once (an event
    // written to all may fill one again); the wait, as a blocked write would, lasts while a
    // consumer downstream frees nothing (a stalled one is reported by its own node) and ends
    // when a partition is released.
    loop {
        match gate
            .wait_for_outputs(outputs, None)
            .map_err(Failed::reading)?
        {
            OutputWait::Available => return Ok(()),
            OutputWait::Event(item) => {
                injected.on_priority_item(consumer, outputs, deserializers, item)?;
            }
        }
    }
}

/// The faults injected into the subtask's input (hidden `--inject`) and what they hold back.
#[derive(Default)]
struct Injected {
    fault: Option<Fault>,
    /// A record held back (`reorder`), handed on after the next of its channel.
    held: Option<(usize, Vec<u8>)>,
    /// A barrier held back (`late-barrier`), handed over after the next record.
    late_barrier: Option<CheckpointBarrier>,
    barrier_delayed: bool,
}

impl Injected {
    /// The record held back on `channel`, handed on now.
    fn release_held(
        &mut self,
        consumer: &mut Consumer<'_>,
        outputs: &mut [Output],
        channel: usize,
    ) -> Result<(), Failed> {
        if self.held.as_ref().is_some_and(|(c, _)| *c == channel) {
            let (c, late) = self.held.take().expect("checked");
            handle(consumer, outputs, c, &late)?;
        }
        Ok(())
    }

    /// An item of a priority read (an event: such reads hand out nothing else).
    fn on_priority_item(
        &mut self,
        consumer: &mut Consumer<'_>,
        outputs: &mut [Output],
        deserializers: &mut [RecordDeserializer],
        item: BufferOrEvent,
    ) -> Result<(), Failed> {
        // The library's priority reads hand out events only; should that ever change, the
        // subtask fails with a report instead of taking the whole node down.
        let GateItem::Event { event, .. } = item.item else {
            return Err(format!(
                "channel {}: a priority read handed out data, not an event",
                item.channel
            )
            .into());
        };
        self.on_event(consumer, outputs, deserializers, item.channel, event)
    }

    /// An event of `channel`, read in turn or while the task's output was back-pressured.
    fn on_event(
        &mut self,
        consumer: &mut Consumer<'_>,
        outputs: &mut [Output],
        deserializers: &mut [RecordDeserializer],
        channel: usize,
        event: Event,
    ) -> Result<(), Failed> {
        match event {
            Event::EndOfPartition => {
                self.release_held(consumer, outputs, channel)?;
                deserializers[channel]
                    .finish()
                    .map_err(|e| format!("channel {channel}: {e}"))?;
                consumer.channels[channel].ended = true;
            }
            Event::CheckpointBarrier(barrier) => {
                if self.fault == Some(Fault::LateBarrier) && !self.barrier_delayed {
                    self.barrier_delayed = true;
                    self.late_barrier = Some(barrier);
                    return Ok(());
                }
                if self.fault == Some(Fault::LoseBarrier)
                    && !self.barrier_delayed
                    && !outputs.is_empty()
                {
                    self.barrier_delayed = true;
                    consumer.barrier(&barrier);
                    for output in outputs.iter_mut() {
                        output.barriers_written += 1;
                    }
                    return Ok(());
                }
                hand_over(consumer, outputs, &barrier)?;
            }
            Event::CancelCheckpointMarker(id) => {
                consumer.cancelled(id);
                for output in outputs.iter_mut() {
                    output.cancel_checkpoint(id)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// FLIP-147 before the end: every output says no record follows (EndOfData) and waits for
/// its consumers to acknowledge that they processed every record (their checkpointed gates
/// do as they read the EndOfData). That takes as long as the slowest consumer's backlog, so
/// the bound is generous ([`END_OF_DATA_STALLS`] stall timeouts). A consumer gone meanwhile
/// (released unacknowledged) or a wait that runs out does not fail the subtask, whose finish
/// goes on as before; the report's flag says so, and the cluster's verdict counts it against
/// a run in which nothing failed.
fn end_of_data(
    outputs: &mut [Output],
    stall: Duration,
    report: &mut SubtaskReport,
) -> Result<(), Failed> {
    for output in outputs.iter_mut() {
        let edge = output.edge;
        let partition = output.writer.partition_mut();
        partition
            .notify_end_of_data(StopMode::Drain)
            .map_err(|e| Failed::writing(&e, format!("ending the data of edge {edge}: {e}")))?;
    }
    let deadline = Instant::now() + stall * END_OF_DATA_STALLS;
    for output in outputs.iter() {
        let waited = output
            .writer
            .partition()
            .wait_all_data_processed(Some(deadline));
        if !matches!(waited, Ok(true)) {
            report.unacknowledged_end_of_data = true;
        }
    }
    Ok(())
}

/// How many stall timeouts a producer waits for its consumers' acknowledgement of the end of
/// data, and (one more) a consumer that has every channel's EndOfData waits for their ends:
/// a producer sends its end only after the acknowledgements of all its consumers, the
/// slowest one's backlog drained.
const END_OF_DATA_STALLS: u32 = 10;

/// The subtask is handed a checkpoint: counted, and its barrier sent on.
fn hand_over(
    consumer: &mut Consumer<'_>,
    outputs: &mut [Output],
    barrier: &CheckpointBarrier,
) -> Result<(), Failed> {
    consumer.barrier(barrier);
    for output in outputs.iter_mut() {
        output.barrier(*barrier)?;
    }
    Ok(())
}

/// Checks one record and forwards it to every output.
fn handle(
    consumer: &mut Consumer<'_>,
    outputs: &mut [Output],
    channel: usize,
    record: &[u8],
) -> Result<(), Failed> {
    let checksum = consumer.record(channel, record);
    if !outputs.is_empty() {
        for output in outputs.iter_mut() {
            output.emit(record, checksum)?;
        }
        consumer.records_out += 1;
    }
    Ok(())
}
