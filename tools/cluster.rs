//! `fluxgate cluster`: runs a topology on a loopback cluster of `fluxgate node` processes and
//! verifies that every sink received exactly the records the topology implies.
//!
//! The cluster makes a temporary rendezvous directory, starts one `node` child per node (this
//! executable), waits for all of them within the timeout (killing stragglers), reads their
//! reports and checks:
//!
//! * every link (producer subtask → consumer subtask of an edge): what the consumer read equals
//!   what the producer wrote, in count and checksum — a shortfall is a loss, an excess a
//!   duplicate;
//! * every sink stage: per generator subtask, the records received equal the records emitted
//!   times the copies the topology makes (broadcast edges multiply, parallel paths add up);
//! * what the subtasks found themselves: sequence numbers going back or repeating on a channel
//!   (where the topology keeps a producer's order), corrupt payloads, records of a hash edge at
//!   the wrong subtask, checkpoint barriers out of order;
//! * every checkpoint, link by link: handed to the consumer (or cancelled there), and handed
//!   over where the producer wrote its barrier in the link's records (see
//!   `check_barrier_placement`).

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fluxgate::io::Transport;

use crate::netns::NodeNamespace;
use crate::node::{node_file, Fault, NodeReport, ProgressLine, Tally};
use crate::topology::{StageKind, Topology};

/// Options of `fluxgate cluster`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:
  fluxgate cluster examples/topologies/three-node.toml
  fluxgate cluster job.toml --timeout 60 --transport epoll --keep
  fluxgate cluster job.toml --reports node-0.json node-1.json   # nodes run elsewhere

The topology format is described in the README (section Tools) and in
examples/topologies/three-node.toml.")]
pub struct ClusterArgs {
    /// The topology file (TOML).
    #[arg(value_name = "TOPOLOGY.toml")]
    pub topology: PathBuf,
    /// Seconds the whole run may take; nodes still running then are killed.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// auto | uring | epoll (overrides `[cluster] transport`).
    #[arg(long)]
    pub transport: Option<Transport>,
    /// Seconds a consuming subtask may receive nothing before it reports a stall.
    #[arg(long, default_value_t = 30.0)]
    pub stall_timeout: f64,
    /// Keep the rendezvous directory (node logs and reports) and print where it is.
    #[arg(long)]
    pub keep: bool,
    /// Start nothing: verify the reports (stdout) of nodes run with `fluxgate node --peers`.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub reports: Vec<PathBuf>,
    /// Testing the verification: one damaged record (see `fluxgate node`).
    #[arg(long, value_enum, hide = true)]
    pub inject: Option<Fault>,
}

/// Runs `fluxgate cluster`.
pub fn run(args: &ClusterArgs) -> Result<(), String> {
    let topology = Topology::load(&args.topology)?;
    let path = fs::canonicalize(&args.topology)
        .map_err(|e| format!("cannot resolve `{}`: {e}", args.topology.display()))?;
    if !args.reports.is_empty() {
        return verify_reports(&topology, args);
    }
    let timeout = secs("timeout", args.timeout)?;
    // Checked here, once, rather than failing every node at its start.
    secs("stall-timeout", args.stall_timeout)?;
    // Ctrl-C or SIGTERM stop the run: its nodes are killed and its temporary directory
    // removed, instead of both being left behind with the dead parent.
    crate::netns::catch_interrupts(false)?;
    let dir = TempDir::new(args.keep)?;
    let launch = Launch {
        topology_path: &path,
        dir: dir.path(),
        nodes: topology.nodes,
        timeout,
        stall_timeout: args.stall_timeout,
        transport: args.transport,
        inject: args.inject,
        namespaces: None,
        cancel: Some(&crate::netns::INTERRUPTED),
        kills: &[],
    };
    println!(
        "cluster: {} node{}, {} stages, {} edges, topology {}",
        topology.nodes,
        if topology.nodes == 1 { "" } else { "s" },
        topology.stages.len(),
        topology.edges.len(),
        args.topology.display()
    );
    let edges: Vec<String> = topology
        .edges
        .iter()
        .map(|e| {
            format!(
                "{} -{}-> {}",
                topology.stages[e.from].name,
                e.partitioner.name(),
                topology.stages[e.to].name
            )
        })
        .collect();
    println!("edges:   {}", edges.join(", "));
    let outcome = launch.run(&mut |_, _| {})?;
    let verification = verify(&topology, &outcome);
    print_summary(&topology, &outcome, &verification);
    if args.keep {
        println!("node logs and reports: {}", dir.path().display());
    }
    verification.verdict()
}

/// `--reports`: verifies the JSON lines of nodes run elsewhere (`fluxgate node --peers`).
fn verify_reports(topology: &Topology, args: &ClusterArgs) -> Result<(), String> {
    let mut reports: Vec<Option<NodeReport>> = vec![None; topology.nodes];
    for path in &args.reports {
        let text = fs::read_to_string(path)
            .map_err(|e| format!("cannot read report `{}`: {e}", path.display()))?;
        let mut found = false;
        for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
            let report: NodeReport = serde_json::from_str(line)
                .map_err(|e| format!("report `{}`: not a node report: {e}", path.display()))?;
            let index = report.node;
            let slot = reports.get_mut(index).ok_or_else(|| {
                format!(
                    "report `{}`: node {index}, but the topology has {} nodes",
                    path.display(),
                    topology.nodes
                )
            })?;
            if slot.is_some() {
                return Err(format!("node {index} is reported twice"));
            }
            *slot = Some(report);
            found = true;
        }
        if !found {
            return Err(format!("report `{}` holds no node report", path.display()));
        }
    }
    let elapsed = reports
        .iter()
        .flatten()
        .map(|r| r.elapsed_ms)
        .max()
        .unwrap_or(0);
    let outcome = Outcome {
        nodes: reports
            .into_iter()
            .map(|report| NodeOutcome {
                killed: report.is_none().then(|| "no report given".to_string()),
                addr: report.as_ref().map(|r| r.addr.clone()),
                report,
                status: None,
                stderr_tail: String::new(),
            })
            .collect(),
        elapsed: Duration::from_millis(elapsed),
        kills: Vec::new(),
    };
    let verification = verify(topology, &outcome);
    print_summary(topology, &outcome, &verification);
    verification.verdict()
}

/// Longest a duration flag of the tools may ask for, in seconds (a week): far beyond any run,
/// and short enough that `Instant::now()` plus a few of it never overflows.
const MAX_FLAG_SECS: f64 = 7.0 * 86_400.0;

/// `--what`'s value in seconds as a duration: not negative, not NaN, at most a week.
pub(crate) fn secs(what: &str, value: f64) -> Result<Duration, String> {
    if !(0.0..=MAX_FLAG_SECS).contains(&value) {
        return Err(format!(
            "--{what} {value}: a number of seconds from 0 to {MAX_FLAG_SECS}"
        ));
    }
    Duration::try_from_secs_f64(value).map_err(|_| format!("--{what} {value}: not a duration"))
}

/// A directory under the system's temp dir, removed on drop unless kept.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    /// A new empty directory.
    pub fn new(keep: bool) -> Result<Self, String> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "fluxgate-cluster-{}-{nanos:09}",
            std::process::id()
        ));
        fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create `{}`: {e}", path.display()))?;
        Ok(Self { path, keep })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// How one node process ended.
#[derive(Debug)]
pub struct NodeOutcome {
    /// Its report, if it wrote one.
    pub report: Option<NodeReport>,
    /// Its exit status (None: killed by us).
    pub status: Option<ExitStatus>,
    /// Why it was killed.
    pub killed: Option<String>,
    /// The last lines it wrote to stderr.
    pub stderr_tail: String,
    /// Where it listened (from its report, else from the rendezvous directory).
    pub addr: Option<String>,
}

/// What a cluster run produced.
#[derive(Debug)]
pub struct Outcome {
    /// Per node.
    pub nodes: Vec<NodeOutcome>,
    /// From the first spawn to the last exit.
    pub elapsed: Duration,
    /// The planned kills, as they happened.
    pub kills: Vec<KillRecord>,
}

/// A node to SIGKILL while the cluster runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlannedKill {
    /// The node.
    pub node: usize,
    /// How long after the nodes were started.
    pub after: Duration,
}

/// A planned kill as it happened.
#[derive(Clone, Copy, Debug)]
pub struct KillRecord {
    /// What was planned.
    pub planned: PlannedKill,
    /// When SIGKILL was sent, since the nodes were started; None: the node had exited before.
    pub at: Option<Duration>,
    /// The same moment on the wall clock, ms since the Unix epoch (what the nodes stamp their
    /// errors with, so the difference is the detection delay).
    pub at_unix_ms: u64,
}

/// Starting the node processes of a cluster.
#[derive(Debug)]
pub struct Launch<'a> {
    /// The topology file the nodes read (absolute).
    pub topology_path: &'a Path,
    /// The rendezvous directory.
    pub dir: &'a Path,
    /// Node count.
    pub nodes: usize,
    /// The whole run's bound.
    pub timeout: Duration,
    /// Passed to the nodes.
    pub stall_timeout: f64,
    /// Passed to the nodes.
    pub transport: Option<Transport>,
    /// Passed to the nodes.
    pub inject: Option<Fault>,
    /// Run node i in network namespace i, bound to its address there (else on loopback).
    pub namespaces: Option<Namespaced<'a>>,
    /// When set (by a signal), the run stops: every node is killed and `run` fails.
    pub cancel: Option<&'a AtomicBool>,
    /// Nodes to SIGKILL during the run. With any, a failed node no longer cuts the others'
    /// time short ([`FAILURE_GRACE`]): the survivors are expected to fail, each in its own
    /// time, and must exit on their own within the timeout.
    pub kills: &'a [PlannedKill],
}

/// Nodes each in a network namespace: `ip netns exec NAME fluxgate node ... --bind ADDR:0`.
#[derive(Clone, Copy, Debug)]
pub struct Namespaced<'a> {
    /// The `ip` program.
    pub ip: &'a Path,
    /// Node i's namespace and address.
    pub nodes: &'a [NodeNamespace],
}

/// How long past its timeout the cluster waits before it kills the nodes: each node counts
/// the same timeout from its own, later start, and a node stuck at the end reports its stuck
/// subtasks and connections itself when that runs out, before the kill.
const NODE_REPORT_GRACE: Duration = Duration::from_secs(5);

/// After the first node fails, how long the others may go on before they are killed.
const FAILURE_GRACE: Duration = Duration::from_secs(5);

/// The node processes not reaped yet: killed and reaped when dropped, so a launcher that
/// returns early or unwinds (a panic, e.g. a progress line printed into a closed pipe) leaves
/// none running in the directory and namespaces its caller then removes.
struct Running(Vec<Option<Child>>);

impl Drop for Running {
    fn drop(&mut self) {
        for mut child in self.0.iter_mut().filter_map(Option::take) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Launch<'_> {
    /// Spawns the nodes, waits for them (calling `tick` about once a second with the nodes'
    /// progress), kills stragglers and collects the reports.
    pub fn run(&self, tick: &mut dyn FnMut(Duration, &[ProgressLine])) -> Result<Outcome, String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find the fluxgate executable: {e}"))?;
        let started = Instant::now();
        let deadline = started + self.timeout + NODE_REPORT_GRACE;
        let mut running = Running(Vec::with_capacity(self.nodes));
        for index in 0..self.nodes {
            // A spawn that fails drops `running`: the nodes started are killed.
            running.0.push(Some(self.spawn(&exe, index)?));
        }
        let children = &mut running.0;
        let mut statuses: Vec<Option<ExitStatus>> = vec![None; self.nodes];
        let mut killed: Vec<Option<String>> = vec![None; self.nodes];
        let mut first_failure: Option<(usize, Instant)> = None;
        let mut next_tick = started + Duration::from_secs(1);
        let mut kills: Vec<Option<KillRecord>> = vec![None; self.kills.len()];
        loop {
            let now = Instant::now();
            for (planned, record) in self.kills.iter().zip(kills.iter_mut()) {
                if record.is_some() || now < started + planned.after {
                    continue;
                }
                let at_unix_ms = super::node::unix_millis();
                let at = children[planned.node].take().and_then(|mut child| {
                    // Exited since the last look: it is gone already, and its status is kept
                    // (a kill of an unreaped process still "succeeds").
                    if let Ok(Some(status)) = child.try_wait() {
                        statuses[planned.node] = Some(status);
                        return None;
                    }
                    // SIGKILL: no orderly close, the kernel resets the node's connections.
                    let _ = child.kill();
                    let _ = child.wait();
                    Some(started.elapsed())
                });
                if let Some(at) = at {
                    killed[planned.node] = Some(format!(
                        "killed (SIGKILL) as planned, {:.2} s into the run",
                        at.as_secs_f64()
                    ));
                }
                *record = Some(KillRecord {
                    planned: *planned,
                    at,
                    at_unix_ms,
                });
            }
            for (index, slot) in children.iter_mut().enumerate() {
                let Some(child) = slot else { continue };
                match child.try_wait() {
                    Ok(Some(status)) => {
                        statuses[index] = Some(status);
                        *slot = None;
                        if !status.success() && first_failure.is_none() && self.kills.is_empty() {
                            first_failure = Some((index, now));
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        killed[index] = Some(format!("waiting for it failed: {e}"));
                        let _ = child.kill();
                        let _ = child.wait();
                        *slot = None;
                    }
                }
            }
            if children.iter().all(Option::is_none) {
                break;
            }
            let reason = if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                Some("killed: the run was interrupted".to_string())
            } else if now >= deadline {
                Some(format!(
                    "killed: still running after the timeout of {:.0} s",
                    self.timeout.as_secs_f64()
                ))
            } else {
                first_failure
                    .filter(|(_, at)| now >= *at + FAILURE_GRACE)
                    .map(|(failed, _)| {
                        format!(
                            "killed: still running {:.0} s after node {failed} failed",
                            FAILURE_GRACE.as_secs_f64()
                        )
                    })
            };
            if let Some(reason) = reason {
                for (index, slot) in children.iter_mut().enumerate() {
                    if let Some(mut child) = slot.take() {
                        let _ = child.kill();
                        let _ = child.wait();
                        killed[index] = Some(reason.clone());
                    }
                }
                break;
            }
            if now >= next_tick {
                next_tick += Duration::from_secs(1);
                let progress: Vec<ProgressLine> = (0..self.nodes)
                    .map(|i| {
                        fs::read_to_string(node_file(self.dir, i, "progress"))
                            .ok()
                            .and_then(|t| serde_json::from_str(&t).ok())
                            .unwrap_or_default()
                    })
                    .collect();
                tick(started.elapsed(), &progress);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let elapsed = started.elapsed();
        if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err("interrupted: every node was stopped".into());
        }
        let nodes = (0..self.nodes)
            .map(|index| {
                let report = fs::read_to_string(node_file(self.dir, index, "result"))
                    .ok()
                    .and_then(|text| serde_json::from_str::<NodeReport>(&text).ok());
                let addr = report.as_ref().map(|r| r.addr.clone()).or_else(|| {
                    fs::read_to_string(node_file(self.dir, index, "addr"))
                        .ok()
                        .map(|text| text.trim().to_string())
                });
                NodeOutcome {
                    report,
                    status: statuses[index],
                    killed: killed[index].take(),
                    stderr_tail: tail(&node_file(self.dir, index, "stderr"), 12),
                    addr,
                }
            })
            .collect();
        Ok(Outcome {
            nodes,
            elapsed,
            kills: kills.into_iter().flatten().collect(),
        })
    }

    fn spawn(&self, exe: &Path, index: usize) -> Result<Child, String> {
        let open = |suffix: &str| {
            let path = node_file(self.dir, index, suffix);
            fs::File::create(&path).map_err(|e| format!("cannot create `{}`: {e}", path.display()))
        };
        let mut command = match &self.namespaces {
            Some(namespaces) => {
                let mut command = Command::new(namespaces.ip);
                command
                    .args(["netns", "exec", &namespaces.nodes[index].name])
                    .arg(exe);
                command
            }
            None => Command::new(exe),
        };
        command
            .arg("node")
            .arg("--topology")
            .arg(self.topology_path)
            .arg("--index")
            .arg(index.to_string())
            .arg("--rendezvous")
            .arg(self.dir)
            .arg("--timeout")
            .arg(format!("{:.3}", self.timeout.as_secs_f64()))
            .arg("--stall-timeout")
            .arg(self.stall_timeout.to_string())
            .stdin(Stdio::null())
            .stdout(open("stdout")?)
            .stderr(open("stderr")?);
        if let Some(transport) = self.transport {
            command.arg("--transport").arg(match transport {
                Transport::Auto => "auto",
                Transport::Uring => "uring",
                Transport::Epoll => "epoll",
            });
        }
        if let Some(namespaces) = &self.namespaces {
            command
                .arg("--bind")
                .arg(format!("{}:0", namespaces.nodes[index].addr));
        }
        if let Some(fault) = self.inject {
            let name = fault
                .to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_default();
            command.arg("--inject").arg(name);
        }
        command
            .spawn()
            .map_err(|e| format!("cannot start node {index} ({}): {e}", exe.display()))
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// Verification.

/// One stage's line of the summary.
#[derive(Debug, Default)]
pub struct Row {
    stage: String,
    kind: &'static str,
    parallelism: usize,
    nodes: String,
    reported: usize,
    records_in: u64,
    records_out: u64,
    bytes_in: u64,
    lost: u64,
    duplicated: u64,
    reordered: u64,
    corrupt: u64,
    misrouted: u64,
    checkpoints: Option<(u64, u64)>,
}

/// Where each consumer subtask was handed its checkpoints, against where its producers wrote
/// the barriers, link by link, for links both sides reported in full (records in the same
/// count: a link that lost or gained records is reported as such):
/// - every barrier a producer wrote to a link came through the consumer's channel, once
///   (counted by the consumer's barrier handler, whether its checkpoint reached the subtask
///   or was cancelled or subsumed: a cancellation may be legitimate, a lost barrier is not);
/// - every checkpoint a producer wrote to a link was handed to its consumer, or cancelled or
///   subsumed there ([`SubtaskReport::cancelled_checkpoints`](crate::node::SubtaskReport));
/// - one handed over aligned came after exactly the records its producers wrote before its
///   barrier (or all of a link that ended without it): none missing, none from behind it;
/// - one handed over unaligned came before any record from behind its barrier;
/// - with aligned checkpoints only, a consumer that did not fail cancelled none: no barrier
///   can overtake another there, so a cancelled or subsumed one lost its barrier somewhere.
fn check_barrier_placement(
    topology: &Topology,
    reports: &HashMap<(usize, usize), &crate::node::SubtaskReport>,
) -> BarrierPlacement {
    let mut placement = BarrierPlacement::default();
    let problems = &mut placement.problems;
    let aligned_only = topology
        .checkpoints
        .is_some_and(|c| c.mode == crate::topology::CheckpointMode::Aligned);
    if aligned_only {
        let mut consumers: Vec<_> = reports
            .iter()
            .filter(|(_, r)| r.failure.is_none() && !r.cancelled_checkpoints.is_empty())
            .collect();
        consumers.sort_by_key(|(key, _)| **key);
        for ((stage, subtask), report) in consumers {
            problems.push(format!(
                "{}[{subtask}] cancelled checkpoint(s) {:?} though every checkpoint is aligned: \
                 one of their barriers went missing",
                topology.stages[*stage].name, report.cancelled_checkpoints
            ));
        }
    }
    for (e, edge) in topology.edges.iter().enumerate() {
        let (from, to) = (edge.from, edge.to);
        for producer in 0..topology.stages[from].parallelism {
            let Some(producer_report) = reports.get(&(from, producer)) else {
                continue;
            };
            for link in producer_report.sent.iter().filter(|l| l.edge == e) {
                let consumer = link.peer;
                let Some(consumer_report) = reports.get(&(to, consumer)) else {
                    continue;
                };
                let Some(got) = consumer_report
                    .received
                    .iter()
                    .find(|l| l.edge == e && l.peer == producer)
                else {
                    continue;
                };
                if !got.ended || got.records != link.records {
                    continue;
                }
                let what = format!(
                    "{}[{producer}] -> {}[{consumer}]",
                    topology.stages[from].name, topology.stages[to].name
                );
                placement.links += 1;
                placement.handovers += got.barriers.len();
                // Every barrier written came through the link's channel, once, whether or
                // not its checkpoint reached the subtask: a cancelled or subsumed checkpoint
                // hides no barrier lost on this link. (A consumer that failed read its gate's
                // counts off at no end: not counted.)
                if consumer_report.error.is_none() && got.barrier_count != link.barrier_count {
                    problems.push(format!(
                        "{what}: {} barriers written, {} arrived",
                        link.barrier_count, got.barrier_count
                    ));
                }
                let complete = link.barriers.len() < crate::node::MAX_BARRIER_MARKS
                    && got.barriers.len() < crate::node::MAX_BARRIER_MARKS
                    && consumer_report.cancelled_checkpoints.len() < crate::node::MAX_BARRIER_MARKS;
                for sent in &link.barriers {
                    let handed = got.barriers.iter().any(|m| m.id == sent.id);
                    if complete
                        && !handed
                        && !consumer_report.cancelled_checkpoints.contains(&sent.id)
                    {
                        problems.push(format!(
                            "{what}: checkpoint {} was written but never handed over or cancelled",
                            sent.id
                        ));
                    }
                }
                for handed in &got.barriers {
                    let before = match link.barriers.iter().find(|m| m.id == handed.id) {
                        Some(sent) => sent.records,
                        // Never written to this link: it ended first.
                        None if complete => link.records,
                        None => continue,
                    };
                    if handed.aligned && handed.records != before {
                        problems.push(format!(
                            "{what}: checkpoint {} handed over aligned after {} records of the link, its barrier came after {before}",
                            handed.id, handed.records
                        ));
                    } else if handed.records > before {
                        problems.push(format!(
                            "{what}: checkpoint {} handed over after {} records of the link, {} of them from behind its barrier",
                            handed.id,
                            handed.records,
                            handed.records - before
                        ));
                    }
                }
            }
        }
    }
    placement
}

/// What [`check_barrier_placement`] found.
#[derive(Debug, Default)]
struct BarrierPlacement {
    /// Links checked (both sides reported in full).
    links: usize,
    /// Checkpoint hand-overs checked, summed over those links.
    handovers: usize,
    problems: Vec<String>,
}

/// The verdict of a run.
#[derive(Debug, Default)]
pub struct Verification {
    rows: Vec<Row>,
    links: usize,
    links_ok: usize,
    links_unchecked: usize,
    /// Checkpoint hand-overs checked against where their barriers fell (None: the run had
    /// no checkpoints), on `barrier_links` links.
    barrier_handovers: Option<usize>,
    barrier_links: usize,
    /// Hand-overs or links that disagree with where their barriers fell.
    barrier_problems: usize,
    /// Per checkpoint handed to a sink subtask: ms from its start to that hand-over.
    sink_barrier_delays_ms: Vec<u64>,
    sinks: Vec<String>,
    /// Nodes whose network pool was full at exit, of those that reported.
    pools_full: usize,
    pools_reported: usize,
    problems: Vec<String>,
    /// Records all sinks received.
    pub sink_records: u64,
    /// Bytes of those.
    pub sink_bytes: u64,
}

impl Verification {
    /// Ok, or the reason for a non-zero exit.
    pub fn verdict(&self) -> Result<(), String> {
        verdict("cluster", &self.problems)
    }
}

/// What a subtask's report says went wrong with the records it read: one line per kind.
pub(crate) fn damage(report: &super::node::SubtaskReport) -> impl Iterator<Item = String> {
    [
        ("records reordered", report.reorders),
        ("records duplicated", report.duplicates),
        ("records corrupt", report.corrupt),
        ("records misrouted (hash edge)", report.misrouted),
        ("checkpoint barriers out of order", report.barrier_errors),
    ]
    .into_iter()
    .filter(|&(_, n)| n > 0)
    .map(|(what, n)| format!("{n} {what}"))
}

/// `Ok` without problems; else the `run` run's first problem (its first line) and how many
/// more there are (they were listed above).
pub(crate) fn verdict(run: &str, problems: &[String]) -> Result<(), String> {
    let Some(first) = problems.first() else {
        return Ok(());
    };
    let first = first.lines().next().unwrap_or_default();
    Err(match problems.len() - 1 {
        0 => format!("the {run} run failed: {first}"),
        more => format!("the {run} run failed: {first} (and {more} more problems, listed above)"),
    })
}

/// A node's network pool at exit as a problem: not full (a segment leaked), or never checked
/// (the node gave up waiting, or an older node wrote the report).
pub(crate) fn pool_problem(node: usize, report: &NodeReport) -> Option<String> {
    match report.pool_at_exit {
        Some(pool) if pool.is_full() => None,
        Some(pool) => Some(format!(
            "node {node}: network pool not full at exit: {} of {} segments back",
            pool.free, pool.total
        )),
        None => Some(format!(
            "node {node}: its network pool was not checked at exit"
        )),
    }
}

/// Checks the nodes' reports against each other and against the topology.
pub fn verify(topology: &Topology, outcome: &Outcome) -> Verification {
    let mut v = Verification::default();
    // Node failures.
    for (index, node) in outcome.nodes.iter().enumerate() {
        match &node.report {
            Some(report) => {
                for error in &report.errors {
                    v.problems.push(format!("node {index}: {error}"));
                }
                v.pools_reported += 1;
                match pool_problem(index, report) {
                    None => v.pools_full += 1,
                    Some(problem) => v.problems.push(problem),
                }
                // A node that failed after writing a clean report (today every non-zero exit
                // comes with errors in the report; this keeps it so).
                if let Some(status) = node.status.filter(|s| !s.success()) {
                    if report.errors.is_empty() {
                        v.problems
                            .push(format!("node {index}: exited with {status}"));
                    }
                }
            }
            None => {
                let how = match (&node.killed, node.status) {
                    (Some(reason), _) => reason.clone(),
                    (None, Some(status)) => format!("exited with {status}"),
                    (None, None) => "did not run".into(),
                };
                let mut problem = format!("node {index}: no report ({how})");
                if !node.stderr_tail.is_empty() {
                    problem.push_str(":\n    ");
                    problem.push_str(&node.stderr_tail.replace('\n', "\n    "));
                }
                v.problems.push(problem);
            }
        }
        if let (Some(_), Some(reason)) = (&node.report, &node.killed) {
            v.problems.push(format!("node {index}: {reason}"));
        }
    }

    // Index the subtask reports.
    let reports: HashMap<(usize, usize), &crate::node::SubtaskReport> = outcome
        .nodes
        .iter()
        .filter_map(|n| n.report.as_ref())
        .flat_map(|r| r.subtasks.iter())
        .map(|s| ((s.stage_index, s.subtask), s))
        .collect();
    let mut sent: HashMap<(usize, usize, usize), Tally> = HashMap::new();
    let mut received: HashMap<(usize, usize, usize), Tally> = HashMap::new();
    for (&(_, subtask), report) in &reports {
        for link in &report.sent {
            sent.insert(
                (link.edge, subtask, link.peer),
                Tally {
                    records: link.records,
                    checksum: link.checksum,
                },
            );
        }
        for link in &report.received {
            received.insert(
                (link.edge, link.peer, subtask),
                Tally {
                    records: link.records,
                    checksum: link.checksum,
                },
            );
        }
    }

    // Rows ("k of n subtasks reported" only where no node failure explains it).
    let nodes_ok = v.problems.is_empty();
    let mut rows: Vec<Row> = topology
        .stages
        .iter()
        .enumerate()
        .map(|(s, stage)| {
            let nodes: BTreeSet<usize> = (0..stage.parallelism)
                .map(|i| topology.node_of(s, i))
                .collect();
            let mut row = Row {
                stage: stage.name.clone(),
                kind: stage.kind.name(),
                parallelism: stage.parallelism,
                nodes: compact_list(&nodes),
                ..Row::default()
            };
            for subtask in 0..stage.parallelism {
                let Some(report) = reports.get(&(s, subtask)) else {
                    continue;
                };
                row.reported += 1;
                row.records_in += report.records_in;
                row.records_out += report.records_out;
                row.bytes_in += report.bytes_in;
                row.reordered += report.reorders;
                row.corrupt += report.corrupt;
                row.misrouted += report.misrouted;
                if stage.kind != StageKind::Generator && topology.checkpoints.is_some() {
                    let (lo, hi) = row.checkpoints.unwrap_or((u64::MAX, 0));
                    row.checkpoints =
                        Some((lo.min(report.checkpoints), hi.max(report.checkpoints)));
                }
                let name = format!("{}[{subtask}]", stage.name);
                for note in &report.notes {
                    v.problems.push(format!("{name}: {note}"));
                }
                for damage in damage(report) {
                    v.problems.push(format!("{name}: {damage}"));
                }
            }
            if row.reported < stage.parallelism && nodes_ok {
                v.problems.push(format!(
                    "stage `{}`: {} of {} subtasks reported",
                    stage.name, row.reported, stage.parallelism
                ));
            }
            row
        })
        .collect();

    // Links.
    let mut link_problems = Vec::new();
    for (e, edge) in topology.edges.iter().enumerate() {
        let from = &topology.stages[edge.from].name;
        let to = &topology.stages[edge.to].name;
        for producer in 0..topology.stages[edge.from].parallelism {
            for consumer in topology.targets(e, producer) {
                v.links += 1;
                let (Some(s), Some(r)) = (
                    sent.get(&(e, producer, consumer)),
                    received.get(&(e, producer, consumer)),
                ) else {
                    v.links_unchecked += 1;
                    continue;
                };
                let row = &mut rows[edge.to];
                let what = format!("{from}[{producer}] -> {to}[{consumer}]");
                if s.records > r.records {
                    row.lost += s.records - r.records;
                    link_problems.push(format!(
                        "{what}: sent {}, received {} ({} lost)",
                        s.records,
                        r.records,
                        s.records - r.records
                    ));
                } else if r.records > s.records {
                    row.duplicated += r.records - s.records;
                    link_problems.push(format!(
                        "{what}: sent {}, received {} ({} too many)",
                        s.records,
                        r.records,
                        r.records - s.records
                    ));
                } else if s.checksum != r.checksum {
                    link_problems.push(format!(
                        "{what}: {} records, but their checksums differ",
                        s.records
                    ));
                } else {
                    v.links_ok += 1;
                }
            }
        }
    }
    let shown = link_problems.len().min(10);
    let more = link_problems.len() - shown;
    v.problems.extend(link_problems.into_iter().take(shown));
    if more > 0 {
        v.problems
            .push(format!("... and {more} more links that differ"));
    }
    for (&(stage, _), report) in &reports {
        if topology.stages[stage].kind == StageKind::Sink {
            v.sink_barrier_delays_ms
                .extend_from_slice(&report.barrier_delays_ms);
        }
    }
    v.sink_barrier_delays_ms.sort_unstable();
    // FLIP-147: with nothing failed, every consumer acknowledged the end of data it read.
    if reports.values().all(|r| r.failure.is_none()) {
        let mut unacknowledged: Vec<_> = reports
            .iter()
            .filter(|(_, r)| r.unacknowledged_end_of_data)
            .map(|(&(stage, subtask), _)| format!("{}[{subtask}]", topology.stages[stage].name))
            .collect();
        unacknowledged.sort();
        if !unacknowledged.is_empty() {
            v.problems.push(format!(
                "{}: consumers did not acknowledge the end of data (FLIP-147) before the wait ran out or they went away",
                unacknowledged.join(", ")
            ));
        }
    }
    let placement = check_barrier_placement(topology, &reports);
    v.barrier_handovers = topology.checkpoints.map(|_| placement.handovers);
    v.barrier_links = placement.links;
    let barrier_problems = placement.problems;
    v.barrier_problems = barrier_problems.len();
    let shown = barrier_problems.len().min(10);
    let more = barrier_problems.len() - shown;
    v.problems.extend(barrier_problems.into_iter().take(shown));
    if more > 0 {
        v.problems
            .push(format!("... and {more} more misplaced checkpoints"));
    }

    // Generators: what each emitted.
    let mut emitted: HashMap<u32, Tally> = HashMap::new();
    for (s, stage) in topology.stages.iter().enumerate() {
        let Some(generator) = stage.generator else {
            continue;
        };
        for subtask in 0..stage.parallelism {
            let origin = topology.origin(s, subtask);
            let Some(report) = reports.get(&(s, subtask)) else {
                continue;
            };
            let tally = report
                .origins
                .iter()
                .find(|o| o.origin == origin)
                .map(|o| Tally {
                    records: o.records,
                    checksum: o.checksum,
                })
                .unwrap_or_default();
            if let (Some(records), None) = (generator.records, generator.duration) {
                if tally.records != records && report.error.is_none() {
                    v.problems.push(format!(
                        "{}[{subtask}]: emitted {} of {records} records",
                        stage.name, tally.records
                    ));
                }
            }
            emitted.insert(origin, tally);
        }
    }

    // Sinks: per generator subtask, what the topology implies.
    for (t, stage) in topology.stages.iter().enumerate() {
        if stage.kind != StageKind::Sink {
            continue;
        }
        let mut got: HashMap<u32, Tally> = HashMap::new();
        for subtask in 0..stage.parallelism {
            if let Some(report) = reports.get(&(t, subtask)) {
                for o in &report.origins {
                    let entry = got.entry(o.origin).or_default();
                    entry.records += o.records;
                    entry.checksum = entry.checksum.wrapping_add(o.checksum);
                }
            }
        }
        let all_reported = (0..stage.parallelism).all(|i| reports.contains_key(&(t, i)));
        let received_total: u64 = got.values().map(|t| t.records).sum();
        let mut expected_total = 0u64;
        let mut generators = Vec::new();
        let mut unknown = false;
        let mut sink_problems = Vec::new();
        for (g, generator) in topology.stages.iter().enumerate() {
            let copies = topology.expected_copies(t, g);
            if copies == 0 {
                continue;
            }
            generators.push(if copies == 1 {
                format!("`{}`", generator.name)
            } else {
                format!("`{}` x{copies}", generator.name)
            });
            for subtask in 0..generator.parallelism {
                let origin = topology.origin(g, subtask);
                let Some(e) = emitted.get(&origin) else {
                    unknown = true;
                    continue;
                };
                let want = Tally {
                    records: e.records.saturating_mul(copies),
                    checksum: e.checksum.wrapping_mul(copies),
                };
                expected_total += want.records;
                let have = got.remove(&origin).unwrap_or_default();
                if have.records < want.records {
                    sink_problems.push(format!(
                        "sink `{}`: from {}[{subtask}] {} of {} records ({} lost)",
                        stage.name,
                        generator.name,
                        have.records,
                        want.records,
                        want.records - have.records
                    ));
                } else if have.records > want.records {
                    sink_problems.push(format!(
                        "sink `{}`: from {}[{subtask}] {} records, {} expected ({} too many)",
                        stage.name,
                        generator.name,
                        have.records,
                        want.records,
                        have.records - want.records
                    ));
                } else if have.checksum != want.checksum {
                    sink_problems.push(format!(
                        "sink `{}`: from {}[{subtask}] {} records, but the checksum differs",
                        stage.name, generator.name, have.records
                    ));
                }
            }
        }
        if !unknown {
            for (origin, tally) in got {
                sink_problems.push(format!(
                    "sink `{}`: {} records from producer id {origin}, which does not feed it",
                    stage.name, tally.records
                ));
            }
        }
        v.sink_records += received_total;
        v.sink_bytes += rows[t].bytes_in;
        if !all_reported || unknown {
            // A node's report is missing (a problem already): the totals cannot be compared.
            sink_problems.clear();
            v.sinks.push(format!(
                "`{}` received {received_total} records (not checked: {})",
                stage.name,
                if all_reported {
                    "a generator did not report"
                } else {
                    "a sink subtask did not report"
                }
            ));
        } else {
            v.sinks.push(format!(
                "`{}` received {received_total} records, {expected_total} expected from {}{}",
                stage.name,
                generators.join(" + "),
                if sink_problems.is_empty() {
                    ": exact, checksums match"
                } else {
                    ""
                },
            ));
        }
        let shown = sink_problems.len().min(10);
        let more = sink_problems.len() - shown;
        v.problems.extend(sink_problems.into_iter().take(shown));
        if more > 0 {
            v.problems
                .push(format!("... and {more} more producers that differ"));
        }
    }
    v.rows = rows;
    v
}

fn compact_list(items: &BTreeSet<usize>) -> String {
    let items: Vec<usize> = items.iter().copied().collect();
    if items.len() > 3 && items.windows(2).all(|w| w[1] == w[0] + 1) {
        return format!("{}-{}", items[0], items[items.len() - 1]);
    }
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Prints the stage table, the link and sink checks, the problems and the verdict.
pub fn print_summary(topology: &Topology, outcome: &Outcome, v: &Verification) {
    let transports: BTreeSet<&str> = outcome
        .nodes
        .iter()
        .filter_map(|n| n.report.as_ref())
        .map(|r| r.transport.as_str())
        .filter(|t| !t.is_empty())
        .collect();
    if v.rows.iter().all(|r| r.reported == 0) {
        println!("result: FAILED, no subtask reported");
        for problem in &v.problems {
            println!("  - {problem}");
        }
        return;
    }
    let dash = || "-".to_string();
    let mut table = vec![vec![
        "stage".to_string(),
        "kind".into(),
        "par".into(),
        "nodes".into(),
        "records in".into(),
        "records out".into(),
        "MiB in".into(),
        "lost".into(),
        "dup".into(),
        "reorder".into(),
        "corrupt".into(),
        "misrouted".into(),
        "checkpoints".into(),
    ]];
    for row in &v.rows {
        let consumer = row.kind != StageKind::Generator.name();
        let producer = row.kind != StageKind::Sink.name();
        let if_consumer = |n: u64| if consumer { n.to_string() } else { dash() };
        table.push(vec![
            row.stage.clone(),
            row.kind.to_string(),
            row.parallelism.to_string(),
            row.nodes.clone(),
            if_consumer(row.records_in),
            if producer {
                row.records_out.to_string()
            } else {
                dash()
            },
            if consumer {
                format!("{:.1}", row.bytes_in as f64 / (1u64 << 20) as f64)
            } else {
                dash()
            },
            if_consumer(row.lost),
            if_consumer(row.duplicated),
            if_consumer(row.reordered),
            if_consumer(row.corrupt),
            if_consumer(row.misrouted),
            match row.checkpoints {
                Some((lo, hi)) if lo == hi => lo.to_string(),
                Some((lo, hi)) => format!("{lo}-{hi}"),
                None => dash(),
            },
        ]);
    }
    let widths: Vec<usize> = (0..table[0].len())
        .map(|c| {
            table
                .iter()
                .map(|r| r[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for (i, row) in table.iter().enumerate() {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c < 2 || (c == 3 && i > 0) || i == 0 {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            }
            line.push_str("  ");
        }
        println!("{}", line.trim_end());
    }
    let seconds = outcome.elapsed.as_secs_f64().max(1e-9);
    println!(
        "links:  {} of {} producer -> consumer subtask links match in count and checksum{}",
        v.links_ok,
        v.links,
        if v.links_unchecked > 0 {
            format!(
                " ({} not checked: a side did not report)",
                v.links_unchecked
            )
        } else {
            String::new()
        }
    );
    if let Some(handovers) = v.barrier_handovers {
        if v.barrier_problems == 0 {
            println!(
                "checks: {handovers} checkpoint hand-overs on {} links agree with where their barriers fell",
                v.barrier_links
            );
        } else {
            println!(
                "checks: {handovers} checkpoint hand-overs on {} links checked; {} disagree with where their barriers fell (below)",
                v.barrier_links, v.barrier_problems
            );
        }
    }
    if let (Some(_), Some(&max)) = (v.barrier_handovers, v.sink_barrier_delays_ms.last()) {
        let delays = &v.sink_barrier_delays_ms;
        let at = |q: f64| delays[((delays.len() - 1) as f64 * q).round() as usize];
        println!(
            "checks: checkpoints reached the sinks {} ms (p50), {} ms (p90), {max} ms (max) after they started ({} hand-overs)",
            at(0.5),
            at(0.9),
            delays.len()
        );
    }
    for line in &v.sinks {
        println!("sinks:  {line}");
    }
    println!(
        "pools:  {} of {} nodes' network pools full at exit (every segment back){}",
        v.pools_full,
        topology.nodes,
        if v.pools_reported < topology.nodes {
            format!("; {} did not report", topology.nodes - v.pools_reported)
        } else {
            String::new()
        }
    );
    println!(
        "run:    {} nodes ({}), {:.2} s, {:.0} records/s and {:.1} MiB/s into the sinks",
        topology.nodes,
        if transports.is_empty() {
            "transport unknown".to_string()
        } else {
            transports.into_iter().collect::<Vec<_>>().join(", ")
        },
        seconds,
        v.sink_records as f64 / seconds,
        v.sink_bytes as f64 / (1u64 << 20) as f64 / seconds,
    );
    if v.problems.is_empty() {
        println!("result: OK - every sink received exactly the records the topology implies");
    } else {
        println!("result: FAILED");
        for problem in &v.problems {
            println!("  - {problem}");
        }
    }
}
