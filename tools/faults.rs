//! Node loss on purpose: `fluxgate stress --kill NODE@SECONDS` SIGKILLs nodes mid-run (the
//! launcher does it, see `cluster::Launch::kills`), and this module says whether the survivors
//! behaved as the engine promises (README, "When a peer fails"):
//!
//! * a surviving consumer reading from a killed node ends with `ConnectionLost` naming that
//!   node's address, within the fault bound of the kill;
//! * a surviving producer writing to a consumer on a killed node sees its partition
//!   `Released` (instead of blocking), within the bound;
//! * the failure spreads no further than the job's failover region (the subtasks connected to
//!   a killed one through links, as Flink restarts a pipelined region): any other subtask
//!   finishes and its links match exactly, as in a run without faults;
//! * every record a survivor received is intact, in order and not repeated; a link that ended
//!   (EndOfPartition arrived) carried exactly what its producer sent, one cut by the failure
//!   carried a part of it (never more); with aligned checkpoints only, a survivor that did
//!   not fail cancelled none;
//! * a survivor writing to a killed node that finished without seeing `Released` finished
//!   within the bound of the kill (the release met its end);
//! * every surviving node exits on its own (within the timeout) with its network pool full.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use crate::cluster::{KillRecord, Outcome, PlannedKill};
use crate::node::{prefix_mark_records, FailureKind, SubtaskReport};
use crate::topology::Topology;

/// Parses `--kill NODE@SECONDS` values and checks them against the run.
pub fn parse_kills(
    values: &[String],
    nodes: usize,
    duration: Duration,
) -> Result<Vec<PlannedKill>, String> {
    let mut kills: Vec<PlannedKill> = Vec::new();
    for text in values {
        let malformed = || format!("--kill `{text}`: expected NODE@SECONDS, e.g. --kill 1@2.5");
        let (node, seconds) = text.split_once('@').ok_or_else(malformed)?;
        let node: usize = node.trim().parse().map_err(|_| malformed())?;
        let seconds: f64 = seconds.trim().parse().map_err(|_| malformed())?;
        let after = Duration::try_from_secs_f64(seconds).map_err(|_| malformed())?;
        if node >= nodes {
            return Err(format!(
                "--kill {text}: there is no node {node} (--nodes {nodes}: 0 to {})",
                nodes - 1
            ));
        }
        if after >= duration {
            return Err(format!(
                "--kill {text}: {seconds} s is not within the run (--duration {} s): a kill must come while the generators emit",
                duration.as_secs_f64()
            ));
        }
        if kills.iter().any(|k| k.node == node) {
            return Err(format!("--kill {text}: node {node} is killed twice"));
        }
        kills.push(PlannedKill { node, after });
    }
    if !kills.is_empty() && kills.len() == nodes {
        return Err(format!(
            "--kill: all {nodes} nodes would be killed; at least one must survive to be verified"
        ));
    }
    kills.sort_by_key(|k| k.after);
    Ok(kills)
}

/// The verdict of a run with kills: summary lines and problems.
#[derive(Debug, Default)]
pub struct FaultVerification {
    lines: Vec<(&'static str, String)>,
    problems: Vec<String>,
}

impl FaultVerification {
    /// Prints the summary and the verdict.
    pub fn print(&self) {
        for (label, line) in &self.lines {
            println!("{label:<10}{line}");
        }
        if self.problems.is_empty() {
            println!(
                "result: OK - the survivors detected every lost node in time, named it, released what it consumed, and exited with full pools; every record received verifies"
            );
        } else {
            println!("result: FAILED");
            for problem in &self.problems {
                println!("  - {problem}");
            }
        }
    }

    /// Ok, or the reason for a non-zero exit.
    pub fn verdict(&self) -> Result<(), String> {
        super::cluster::verdict("fault", &self.problems)
    }
}

/// A subtask: (stage, subtask index).
type SubtaskId = (usize, usize);

/// Detection delays (ms) of one kind of expected failure.
#[derive(Debug, Default)]
struct Detections {
    expected: usize,
    seen: usize,
    finished_first: usize,
    delays_ms: Vec<u64>,
}

impl Detections {
    fn describe(&self, what: &str, bound: Duration) -> String {
        let mut text = format!("{} of {} {what}", self.seen, self.expected);
        if let (Some(lo), Some(hi)) = (self.delays_ms.iter().min(), self.delays_ms.iter().max()) {
            text.push_str(&format!(
                ", {} after the kill (max detection delay {hi} ms, bound {:.1} s)",
                if lo == hi {
                    format!("{lo} ms")
                } else {
                    format!("{lo}-{hi} ms")
                },
                bound.as_secs_f64()
            ));
        }
        if self.finished_first > 0 {
            text.push_str(&format!(
                "; {} finished without it, within the bound of the kill",
                self.finished_first
            ));
        }
        text
    }
}

/// Checks a run with kills against what the engine promises (see the module docs).
pub fn verify(
    topology: &Topology,
    outcome: &Outcome,
    planned: &[PlannedKill],
    bound: Duration,
) -> FaultVerification {
    let mut v = FaultVerification::default();
    let name = |(s, i): SubtaskId| format!("{}[{i}]", topology.stages[s].name);
    let subtasks: Vec<SubtaskId> = topology
        .stages
        .iter()
        .enumerate()
        .flat_map(|(s, stage)| (0..stage.parallelism).map(move |i| (s, i)))
        .collect();
    let node_of = |(s, i): SubtaskId| topology.node_of(s, i);

    // The kills as they happened.
    let mut killed: BTreeMap<usize, &KillRecord> = BTreeMap::new();
    for record in &outcome.kills {
        let node = record.planned.node;
        match record.at {
            Some(at) => {
                killed.insert(node, record);
                let lost: Vec<String> = subtasks
                    .iter()
                    .filter(|&&t| node_of(t) == node)
                    .map(|&t| name(t))
                    .collect();
                v.lines.push((
                    "faults:",
                    format!(
                        "node {node} ({}) killed (SIGKILL) {:.2} s into the run, planned at {:.2} s; lost with it: {}",
                        outcome.nodes[node].addr.as_deref().unwrap_or("address unknown"),
                        at.as_secs_f64(),
                        record.planned.after.as_secs_f64(),
                        if lost.is_empty() { "no subtask".to_string() } else { lost.join(", ") }
                    ),
                ));
            }
            None => v.lines.push((
                "faults:",
                format!(
                    "node {node} not killed: it had exited before {:.2} s (verified as a survivor)",
                    record.planned.after.as_secs_f64()
                ),
            )),
        }
    }
    // Kills planned after every node had exited never came due.
    for kill in planned {
        if !outcome.kills.iter().any(|k| k.planned == *kill) {
            v.lines.push((
                "faults:",
                format!(
                    "node {} not killed: every node had exited before {:.2} s (verified as a survivor)",
                    kill.node,
                    kill.after.as_secs_f64()
                ),
            ));
        }
    }
    let survivors: Vec<usize> = (0..outcome.nodes.len())
        .filter(|n| !killed.contains_key(n))
        .collect();
    let is_killed = |t: SubtaskId| killed.contains_key(&node_of(t));
    let killed_addr = |node: usize| outcome.nodes[node].addr.clone();

    // Reports of the survivors' subtasks.
    let reports: HashMap<SubtaskId, &SubtaskReport> = survivors
        .iter()
        .filter_map(|&n| outcome.nodes[n].report.as_ref())
        .flat_map(|r| r.subtasks.iter())
        .map(|s| ((s.stage_index, s.subtask), s))
        .collect();

    // The failover region: subtasks connected to a killed one through links.
    let mut region: BTreeSet<SubtaskId> =
        subtasks.iter().copied().filter(|&t| is_killed(t)).collect();
    let mut links: Vec<(usize, SubtaskId, SubtaskId)> = Vec::new();
    for (e, edge) in topology.edges.iter().enumerate() {
        for producer in 0..topology.stages[edge.from].parallelism {
            for consumer in topology.targets(e, producer) {
                links.push((e, (edge.from, producer), (edge.to, consumer)));
            }
        }
    }
    loop {
        let before = region.len();
        for &(_, p, c) in &links {
            if region.contains(&p) || region.contains(&c) {
                region.insert(p);
                region.insert(c);
            }
        }
        if region.len() == before {
            break;
        }
    }

    // Survivor nodes: on their own, in time, pools full, no errors besides their subtasks'.
    let mut pools_full = 0usize;
    let mut on_their_own = 0usize;
    let mut last_exit_ms = 0u64;
    for &n in &survivors {
        let node = &outcome.nodes[n];
        if let Some(reason) = &node.killed {
            v.problems
                .push(format!("node {n} (a survivor) hung: {reason}"));
        }
        if node.killed.is_none() && node.report.is_some() {
            on_their_own += 1;
        }
        let Some(report) = &node.report else {
            if node.killed.is_none() {
                let how = node
                    .status
                    .map_or("did not run".to_string(), |s| format!("exited with {s}"));
                v.problems.push(format!("node {n}: no report ({how})"));
            }
            continue;
        };
        last_exit_ms = last_exit_ms.max(report.elapsed_ms);
        let subtask_errors: BTreeSet<String> = report
            .subtasks
            .iter()
            .filter_map(|s| {
                s.error
                    .as_ref()
                    .map(|e| format!("{}[{}]: {e}", s.stage, s.subtask))
            })
            .collect();
        for error in report
            .errors
            .iter()
            .filter(|e| !subtask_errors.contains(*e))
        {
            v.problems.push(format!("node {n}: {error}"));
        }
        match crate::cluster::pool_problem(n, report) {
            None => pools_full += 1,
            Some(problem) => v.problems.push(problem),
        }
    }

    let aligned_only = topology
        .checkpoints
        .is_some_and(|c| c.mode == crate::topology::CheckpointMode::Aligned);
    // Survivor subtasks: the error each one was expected to end with, if any.
    let mut lost_peer = Detections::default();
    let mut released = Detections::default();
    let mut spread = 0usize;
    let mut finished = 0usize;
    let mut damaged = false;
    for &t in subtasks.iter().filter(|&&t| !is_killed(t)) {
        let Some(report) = reports.get(&t) else {
            if outcome.nodes[node_of(t)].killed.is_none() {
                v.problems.push(format!("{}: no report", name(t)));
            }
            continue;
        };
        for damage in super::cluster::damage(report) {
            damaged = true;
            v.problems.push(format!("{}: {damage}", name(t)));
        }
        for note in &report.notes {
            v.problems.push(format!("{}: {note}", name(t)));
        }
        // As in a run without faults: no barrier overtakes another with aligned checkpoints
        // only, so a consumer that did not fail and still cancelled one lost a barrier.
        if aligned_only && report.error.is_none() && !report.cancelled_checkpoints.is_empty() {
            v.problems.push(format!(
                "{}: cancelled checkpoint(s) {:?} though every checkpoint is aligned and it \
                 did not fail: one of their barriers went missing",
                name(t),
                report.cancelled_checkpoints
            ));
        }
        // Killed nodes this subtask reads from, and those it writes to.
        let (s, i) = t;
        let upstream: BTreeSet<usize> = topology
            .input_channels(s, i)
            .iter()
            .map(|c| topology.node_of(topology.edges[c.edge].from, c.producer))
            .filter(|n| killed.contains_key(n))
            .collect();
        let downstream: BTreeSet<usize> = topology.stages[s]
            .outputs
            .iter()
            .flat_map(|&e| {
                let to = topology.edges[e].to;
                topology
                    .targets(e, i)
                    .into_iter()
                    .map(move |c| topology.node_of(to, c))
            })
            .filter(|n| killed.contains_key(n))
            .collect();
        if !upstream.is_empty() {
            lost_peer.expected += 1;
        } else if !downstream.is_empty() {
            released.expected += 1;
        }
        let Some(error) = &report.error else {
            // Finished: possible only if what linked it to killed nodes had ended before the
            // kills; its links are checked below like any other. Not for a consumer of a
            // killed node: a kill comes while the generators emit (`parse_kills` refuses
            // later ones), so its upstream never ended, and a clean end would hide data cut
            // short (the lost peer's connection taken for an end of partition).
            if !upstream.is_empty() {
                lost_peer.finished_first += 1;
                v.problems.push(format!(
                    "{}: finished without an error though it consumes from a killed node",
                    name(t)
                ));
            } else if !downstream.is_empty() {
                // Every kill comes while the generators emit, and so before any subtask that
                // writes to a killed node finishes, unless the writer found nothing more to
                // send that node: its end (or next record) then meets the release, within the
                // bound. A later clean end means the release was never seen.
                released.finished_first += 1;
                let first_kill = downstream
                    .iter()
                    .filter_map(|n| killed.get(n))
                    .map(|k| k.at_unix_ms)
                    .min();
                if let (Some(kill), Some(done)) = (first_kill, report.finished_at_unix_ms) {
                    let after = done.saturating_sub(kill);
                    if Duration::from_millis(after) > bound {
                        v.problems.push(format!(
                            "{}: finished {after} ms after the kill of a node it writes to \
                             without seeing its partition Released (fault bound {:.1} s)",
                            name(t),
                            bound.as_secs_f64()
                        ));
                    }
                }
            } else {
                finished += 1;
            }
            continue;
        };
        let Some(failure) = &report.failure else {
            v.problems.push(format!(
                "{}: failed without a typed error: {error}",
                name(t)
            ));
            continue;
        };
        // Milliseconds from the latest kill of `nodes` before the failure, or (`Err`) how long
        // before the first of them the failure came: the kill's time is taken before the
        // signal is sent, so only a failure of another cause comes earlier.
        let delay_after = |nodes: &mut dyn Iterator<Item = usize>| {
            let kills: Vec<u64> = nodes
                .filter_map(|n| killed.get(&n))
                .map(|k| k.at_unix_ms)
                .collect();
            let first = *kills.iter().min()?;
            Some(match failure.at_unix_ms.checked_sub(first) {
                None => Err(first - failure.at_unix_ms),
                Some(_) => Ok(kills
                    .iter()
                    .filter_map(|&kill| failure.at_unix_ms.checked_sub(kill))
                    .min()
                    .expect("the first kill came before the failure")),
            })
        };
        let named = failure.peer.as_ref().and_then(|peer| {
            upstream
                .iter()
                .copied()
                .find(|&n| killed_addr(n).as_deref() == Some(peer.as_str()))
        });
        let (delay, counter) = match (failure.kind, named) {
            (FailureKind::ConnectionLost, Some(node)) if !upstream.is_empty() => {
                (delay_after(&mut std::iter::once(node)), &mut lost_peer)
            }
            // The release may have spread from any kill (a consumer that failed on another
            // node's loss released its subpartition), not only from a killed consumer's.
            (FailureKind::Released, _) if upstream.is_empty() && !downstream.is_empty() => {
                (delay_after(&mut killed.keys().copied()), &mut released)
            }
            _ if !upstream.is_empty() => {
                let addresses: Vec<String> = upstream
                    .iter()
                    .map(|&n| format!("node {n} at {}", killed_addr(n).unwrap_or_default()))
                    .collect();
                v.problems.push(format!(
                    "{} reads from {} but ended with {}{} instead of ConnectionLost naming it: {error}",
                    name(t),
                    addresses.join(", "),
                    failure.kind.name(),
                    failure.peer.as_ref().map_or(String::new(), |p| format!(" naming {p}")),
                ));
                continue;
            }
            _ if !downstream.is_empty() => {
                v.problems.push(format!(
                    "{} writes to killed node(s) {} but ended with {} instead of Released: {error}",
                    name(t),
                    downstream
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    failure.kind.name(),
                ));
                continue;
            }
            _ => {
                if !region.contains(&t) {
                    v.problems.push(format!(
                        "{} failed though no killed node is in its region: {error}",
                        name(t)
                    ));
                } else if failure.kind == FailureKind::Stalled {
                    v.problems
                        .push(format!("{} hung in the failed region: {error}", name(t)));
                } else {
                    spread += 1;
                }
                continue;
            }
        };
        counter.seen += 1;
        if let Some(Err(early)) = delay {
            v.problems.push(format!(
                "{}: {} came {early} ms before the kill, so the kill did not cause it: {error}",
                name(t),
                failure.kind.name(),
            ));
        } else if let Some(Ok(delay)) = delay {
            counter.delays_ms.push(delay);
            if Duration::from_millis(delay) > bound {
                v.problems.push(format!(
                    "{}: {} came {delay} ms after the kill, over the fault bound of {:.1} s",
                    name(t),
                    failure.kind.name(),
                    bound.as_secs_f64()
                ));
            }
        }
    }
    v.lines.push((
        "lost:",
        lost_peer.describe(
            "surviving consumers reading from a killed node ended with ConnectionLost naming its address",
            bound,
        ),
    ));
    v.lines.push((
        "released:",
        released.describe(
            "surviving producers writing to a killed node saw their partition Released instead of blocking",
            bound,
        ),
    ));
    let outside = subtasks.iter().filter(|t| !region.contains(t)).count();
    v.lines.push((
        "region:",
        format!(
            "{}; {spread} further subtasks in it failed as the failure spread through their links; {}",
            if outside == 0 {
                "every subtask is linked to a killed one (the failed region is the whole job)"
                    .to_string()
            } else {
                format!(
                    "the failed region holds the subtasks linked to a killed one, {} of {}",
                    region.len(),
                    subtasks.len()
                )
            },
            if outside == 0 {
                "none outside it".to_string()
            } else {
                format!("{finished} of {outside} subtasks outside it finished")
            }
        ),
    ));

    // Links between survivors.
    let (mut exact, mut cut, mut unchecked) = (0usize, 0usize, 0usize);
    // Records of cut links whose running checksum matched the sent one's.
    let mut prefix_checked = 0u64;
    let mut received_total = 0u64;
    for &(e, p, c) in &links {
        let (Some(producer), Some(consumer)) = (reports.get(&p), reports.get(&c)) else {
            unchecked += 1;
            continue;
        };
        let sent = producer.sent.iter().find(|l| l.edge == e && l.peer == c.1);
        let got = consumer
            .received
            .iter()
            .find(|l| l.edge == e && l.peer == p.1);
        let (Some(sent), Some(got)) = (sent, got) else {
            unchecked += 1;
            continue;
        };
        let what = format!("{} -> {}", name(p), name(c));
        if got.ended {
            if (got.records, got.checksum) == (sent.records, sent.checksum) {
                exact += 1;
            } else {
                v.problems.push(format!(
                    "{what}: ended with {} records received of {} sent{}",
                    got.records,
                    sent.records,
                    if got.records == sent.records {
                        " (checksums differ)"
                    } else {
                        ""
                    }
                ));
            }
        } else if got.records > sent.records {
            v.problems.push(format!(
                "{what}: cut by the failure, yet {} records received of {} sent",
                got.records, sent.records
            ));
        } else if !sent.prefix_marks.starts_with(&got.prefix_marks) {
            // The running checksums of the records received at the prefix marks: the first
            // that differs from the sent one's says which records were not a prefix.
            let at = got
                .prefix_marks
                .iter()
                .zip(&sent.prefix_marks)
                .position(|(got, sent)| got != sent)
                .unwrap_or(sent.prefix_marks.len());
            v.problems.push(format!(
                "{what}: cut by the failure, and its first {} records received are not the \
                 first sent (a record lost, added or changed among them)",
                prefix_mark_records(at),
            ));
        } else {
            cut += 1;
            prefix_checked += got
                .prefix_marks
                .len()
                .checked_sub(1)
                .map_or(0, prefix_mark_records);
        }
    }
    for report in reports
        .values()
        .filter(|r| topology.stages[r.stage_index].outputs.is_empty())
    {
        received_total += report.records_in;
    }
    v.lines.push((
        "data:",
        format!(
            "survivors' sinks received {received_total} records, none duplicated, reordered or corrupt{}; links between survivors: {exact} ended and match in count and checksum, {cut} cut by the failure (no more than was sent, and their first {prefix_checked} records in all the first sent); {unchecked} with a killed side not checked",
            if damaged { " (except as listed below)" } else { "" }
        ),
    ));
    v.lines.push((
        "nodes:",
        format!(
            "{} survived: {on_their_own} of {count} exited on their own (the last {:.2} s into the run), {pools_full} of {count} with the network pool full at exit",
            if survivors.len() == 1 {
                format!("node {}", survivors[0])
            } else {
                format!(
                    "nodes {}",
                    survivors.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                )
            },
            last_exit_ms as f64 / 1000.0,
            count = survivors.len()
        ),
    ));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::NodeOutcome;
    use crate::node::{FailureReport, NodeReport, PoolAtExit};

    const KILL_MS: u64 = 1_000_000;

    /// Node 1 killed at `KILL_MS`; on node 0 the sinks lost their peer in time, and the
    /// generator writing to node 1's sink finished without an error `finished_after` ms
    /// after the kill.
    fn verified(finished_after: u64) -> FaultVerification {
        let topology = Topology::parse(crate::topology::TWO_NODE_TEST_TOPOLOGY).unwrap();
        let lost_addr = "127.0.0.1:2".to_string();
        let subtasks = (0..topology.stages.len())
            .flat_map(|s| (0..topology.stages[s].parallelism).map(move |i| (s, i)))
            .filter(|&(s, i)| topology.node_of(s, i) == 0)
            .map(|(s, i)| {
                let mut report = SubtaskReport {
                    stage: topology.stages[s].name.clone(),
                    stage_index: s,
                    subtask: i,
                    ..SubtaskReport::default()
                };
                if s == 0 {
                    report.finished_at_unix_ms = Some(KILL_MS + finished_after);
                } else {
                    report.error = Some("connection lost".into());
                    report.failure = Some(FailureReport {
                        kind: FailureKind::ConnectionLost,
                        peer: Some(lost_addr.clone()),
                        at_unix_ms: KILL_MS + 10,
                    });
                }
                report
            })
            .collect();
        let survivor = NodeOutcome {
            report: Some(NodeReport {
                node: 0,
                subtasks,
                pool_at_exit: Some(PoolAtExit { free: 8, total: 8 }),
                ..NodeReport::default()
            }),
            status: None,
            killed: None,
            stderr_tail: String::new(),
            addr: Some("127.0.0.1:1".into()),
        };
        let lost = NodeOutcome {
            report: None,
            status: None,
            killed: Some("killed (SIGKILL) as planned".into()),
            stderr_tail: String::new(),
            addr: Some(lost_addr),
        };
        let planned = PlannedKill {
            node: 1,
            after: Duration::from_secs(1),
        };
        let outcome = Outcome {
            nodes: vec![survivor, lost],
            elapsed: Duration::from_secs(3),
            kills: vec![KillRecord {
                planned,
                at: Some(Duration::from_secs(1)),
                at_unix_ms: KILL_MS,
            }],
        };
        verify(&topology, &outcome, &[planned], Duration::from_secs(2))
    }

    /// A writer to a killed node that ends cleanly well past the fault bound never saw the
    /// release (it counted as "finished first", however late); within the bound its end met it.
    #[test]
    fn a_writer_to_a_killed_node_finishing_past_the_bound_fails_the_run() {
        let late = verified(5_000);
        assert!(
            late.problems
                .iter()
                .any(|p| p.contains("gen[0]: finished 5000 ms after the kill")),
            "{:?}",
            late.problems
        );
        let in_time = verified(500);
        assert!(in_time.problems.is_empty(), "{:?}", in_time.problems);
    }
}
