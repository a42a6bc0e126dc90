//! The `fluxgate` binary as a user runs it: `cluster` on the example topology, bad inputs
//! (clear messages, non-zero exit, no panic), faults the verification must catch, a short
//! `stress` (also with a node killed: `--kill`), and `bench --format lines`. Every run is
//! bounded: a child still running at its deadline is killed and the test fails.

use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const EXAMPLE: &str = "examples/topologies/three-node.toml";

struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    fn all(&self) -> String {
        format!("--- stdout\n{}--- stderr\n{}", self.stdout, self.stderr)
    }
}

/// Runs that start clusters or exchanges take turns: on a 2-core machine several at once
/// only measure the scheduler.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `fluxgate args` from the crate root; kills it at `limit` (and fails the test).
fn fluxgate(args: &[&str], limit: Duration) -> Run {
    fluxgate_with(Command::new(env!("CARGO_BIN_EXE_fluxgate")), args, limit)
}

/// Runs `command args` (the binary, or a wrapper starting it) as [`fluxgate`] does.
fn fluxgate_with(mut command: Command, args: &[&str], limit: Duration) -> Run {
    let _turn = matches!(args.first(), Some(&("cluster" | "stress" | "bench"))).then(|| {
        HEAVY
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    });
    let mut child = command
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the fluxgate binary starts");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped")));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for fluxgate") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let run = |status| Run {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    };
    match status {
        Some(status) => run(status),
        None => {
            let killed = run(ExitStatus::default());
            panic!(
                "fluxgate {args:?} still ran after {limit:?}; killed\n{}",
                killed.all()
            );
        }
    }
}

/// A file in the temp dir with `text`, named after the test.
fn temp_file(name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("fluxgate-cli-{}-{name}", std::process::id()));
    std::fs::write(&path, text).expect("temp file written");
    path
}

fn example() -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(EXAMPLE))
        .expect("the example topology exists")
}

/// Exits non-zero with `expected` in a one-line-first message on stderr, and no panic.
fn assert_clean_failure(run: &Run, expected: &[&str]) {
    assert!(!run.status.success(), "must fail\n{}", run.all());
    assert_eq!(run.status.code(), Some(1), "exits 1\n{}", run.all());
    for text in expected {
        assert!(
            run.stderr.contains(text),
            "stderr names `{text}`\n{}",
            run.all()
        );
    }
    for bad in ["panicked", "backtrace", "RUST_BACKTRACE", "unwrap"] {
        assert!(
            !run.all().contains(bad),
            "no panic or backtrace text (`{bad}`)\n{}",
            run.all()
        );
    }
    assert!(
        run.stderr.starts_with("fluxgate: "),
        "one clear error line\n{}",
        run.all()
    );
}

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn cluster_runs_the_three_node_example() {
    let run = fluxgate(&["cluster", EXAMPLE, "--timeout", "90", "--keep"], LIMIT);
    // The node logs (a stalled node dumps its connections there) go into the failure message;
    // the directory is removed either way.
    let kept = run
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("node logs and reports: "))
        .map(PathBuf::from);
    let mut logs = String::new();
    if let Some(dir) = &kept {
        for index in 0..3 {
            let path = dir.join(format!("node-{index}.stderr"));
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            logs.push_str(&format!("--- node {index} stderr\n{text}"));
        }
        let _ = std::fs::remove_dir_all(dir);
    }
    assert!(run.status.success(), "{}{logs}", run.all());
    assert!(run.stdout.contains("result: OK"), "{}", run.all());
    assert!(
        run.stdout
            .contains("`sink` received 300000 records, 300000 expected from `source`: exact"),
        "{}",
        run.all()
    );
    assert!(
        run.stdout
            .contains("18 of 18 producer -> consumer subtask links match"),
        "{}",
        run.all()
    );
}

/// The leanest credit Flink allows (no exclusive buffers, one floating buffer per gate) with
/// spanning records and both kinds of checkpoint: every record arrives, no channel stalls.
#[test]
fn cluster_runs_the_floating_only_example() {
    let run = fluxgate(
        &[
            "cluster",
            "examples/topologies/floating-only.toml",
            "--timeout",
            "90",
        ],
        LIMIT,
    );
    assert!(run.status.success(), "{}", run.all());
    assert!(
        run.stdout
            .contains("`sink` received 60000 records, 60000 expected from `source`: exact"),
        "{}",
        run.all()
    );
}

/// A slow sink behind a relay with unaligned checkpoints: the relay waits for its output and
/// takes barriers meanwhile; every record arrives, every hand-over falls where its barriers
/// did, and the summary says how long the checkpoints took to reach the sink.
#[test]
fn cluster_runs_the_back_pressure_example() {
    let run = fluxgate(
        &[
            "cluster",
            "examples/topologies/back-pressure.toml",
            "--timeout",
            "90",
        ],
        LIMIT,
    );
    assert!(run.status.success(), "{}", run.all());
    for expected in [
        "`sink` received 60000 records, 60000 expected from `source`: exact",
        "checkpoint hand-overs on 2 links agree with where their barriers fell",
        "checks: checkpoints reached the sinks ",
    ] {
        assert!(run.stdout.contains(expected), "{expected}\n{}", run.all());
    }
}

#[test]
fn cluster_on_a_missing_file_fails_clearly() {
    let run = fluxgate(&["cluster", "no/such/topology.toml"], LIMIT);
    assert_clean_failure(
        &run,
        &["cannot read topology file", "no/such/topology.toml"],
    );
}

#[test]
fn cluster_on_bad_toml_fails_clearly() {
    let path = temp_file("bad.toml", "[cluster\nnodes = 3\n");
    let run = fluxgate(&["cluster", path.to_str().unwrap()], LIMIT);
    assert_clean_failure(&run, &["TOML parse error at line 1", "expected `]`"]);
    let _ = std::fs::remove_file(path);
}

#[test]
fn cluster_names_an_unknown_partitioner() {
    let text = example().replace("partitioner = \"hash\"", "partitioner = \"zigzag\"");
    let path = temp_file("partitioner.toml", &text);
    let run = fluxgate(&["cluster", path.to_str().unwrap()], LIMIT);
    assert_clean_failure(
        &run,
        &[
            "unknown variant `zigzag`",
            "forward",
            "rebalance",
            "broadcast",
        ],
    );
    let _ = std::fs::remove_file(path);
}

#[test]
fn cluster_refuses_forward_with_unequal_parallelism() {
    let text = example()
        .replace("partitioner = \"hash\"", "partitioner = \"forward\"")
        .replace(
            "name = \"sink\"\nkind = \"sink\"\nparallelism = 3",
            "name = \"sink\"\nkind = \"sink\"\nparallelism = 2",
        );
    let path = temp_file("forward.toml", &text);
    let run = fluxgate(&["cluster", path.to_str().unwrap()], LIMIT);
    assert_clean_failure(
        &run,
        &[
            "forward needs equal parallelism",
            "`relay` has 3",
            "`sink` has 2",
        ],
    );
    let _ = std::fs::remove_file(path);
}

#[test]
fn cluster_refuses_unknown_stages_cycles_and_missing_fields() {
    let cases = [
        (
            example().replace("to = \"sink\"", "to = \"sinc\""),
            "unknown stage `sinc`",
        ),
        (
            example().replace("name = \"relay\"\nkind = \"pass-through\"\nparallelism = 3\n", "name = \"relay\"\nkind = \"pass-through\"\n"),
            "missing field `parallelism`",
        ),
        (
            format!(
                "{}\n[[edge]]\nfrom = \"relay\"\nto = \"relay2\"\npartitioner = \"rebalance\"\n\n[[edge]]\nfrom = \"relay2\"\nto = \"relay\"\npartitioner = \"rebalance\"\n\n[[stage]]\nname = \"relay2\"\nkind = \"pass-through\"\nparallelism = 1\n",
                example()
            ),
            "cycle",
        ),
        (
            example().replace("\"32kb\"", "\"3kb\""),
            "taskmanager.memory.segment-size",
        ),
    ];
    for (i, (text, expected)) in cases.iter().enumerate() {
        let path = temp_file(&format!("invalid-{i}.toml"), text);
        let run = fluxgate(&["cluster", path.to_str().unwrap()], LIMIT);
        assert_clean_failure(&run, &[expected]);
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn cluster_reports_a_port_in_use() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = taken.local_addr().unwrap().port();
    let text = example().replace("base_port = 0", &format!("base_port = {port}"));
    let path = temp_file("port.toml", &text);
    let run = fluxgate(
        &["cluster", path.to_str().unwrap(), "--timeout", "60"],
        LIMIT,
    );
    assert_clean_failure(&run, &["node 0", "Address already in use"]);
    drop(taken);
    let _ = std::fs::remove_file(path);
}

/// A `fluxgate node` run in the background, its output going to files; killed and reaped
/// when dropped, so a failing test leaves none running.
struct BackgroundNode {
    child: std::process::Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl BackgroundNode {
    /// Starts `fluxgate node args`, its output in temp files named after `name`.
    fn start(args: &[&str], name: &str) -> Self {
        let stdout =
            std::env::temp_dir().join(format!("fluxgate-cli-{}-{name}.stdout", std::process::id()));
        let stderr = stdout.with_extension("stderr");
        let child = Command::new(env!("CARGO_BIN_EXE_fluxgate"))
            .arg("node")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).expect("stdout file created"))
            .stderr(std::fs::File::create(&stderr).expect("stderr file created"))
            .spawn()
            .expect("the fluxgate binary starts");
        BackgroundNode {
            child,
            stdout,
            stderr,
        }
    }

    /// Its exit status once it exited, looking until `limit` has passed (None: still running).
    fn exited_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        // Bounded by `deadline`.
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting for fluxgate") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn output(&self) -> String {
        let read = |path: &PathBuf| std::fs::read_to_string(path).unwrap_or_default();
        format!(
            "--- stdout\n{}--- stderr\n{}",
            read(&self.stdout),
            read(&self.stderr)
        )
    }
}

impl Drop for BackgroundNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stdout);
        let _ = std::fs::remove_file(&self.stderr);
    }
}

/// With `--peers`, a node waits only for the nodes it exchanges data with: one linked to
/// none of them may finish and exit before the last host starts. Node 0 runs a generator and
/// a sink joined by a local channel; node 1's generator feeds node 2's sink. Nodes 0 and 1
/// start first; node 2 starts only once node 0 has exited, and every node succeeds.
#[test]
fn with_peers_a_node_waits_only_for_the_nodes_it_exchanges_data_with() {
    let _turn = HEAVY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let topology = temp_file(
        "unlinked.toml",
        r#"
[cluster]
nodes = 3

# Subtask i of a stage runs on node (first id of the stage + i) % 3.
[[stage]]
name = "local-source"   # id 0: node 0
kind = "generator"
parallelism = 1
records = 1000
record_size = 64

[[stage]]
name = "source"         # id 1: node 1
kind = "generator"
parallelism = 1
records = 1000
record_size = 64

[[stage]]
name = "sink"           # id 2: node 2
kind = "sink"
parallelism = 1

[[stage]]
name = "local-sink"     # id 3: node 0
kind = "sink"
parallelism = 1

[[edge]]
from = "local-source"
to = "local-sink"
partitioner = "forward"

[[edge]]
from = "source"
to = "sink"
partitioner = "forward"
"#,
    );
    // Three distinct free ports: the listeners are held until all three are taken.
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    let peers_text: String = listeners
        .iter()
        .map(|l| format!("{}\n", l.local_addr().expect("bound")))
        .collect();
    drop(listeners);
    let peers = temp_file("unlinked.peers", &peers_text);
    let node_args = |index: &'static str| {
        vec![
            "--topology",
            topology.to_str().expect("a UTF-8 temp path"),
            "--index",
            index,
            "--peers",
            peers.to_str().expect("a UTF-8 temp path"),
            "--timeout",
            "60",
        ]
    };
    let mut unlinked = BackgroundNode::start(&node_args("0"), "unlinked-node-0");
    let mut source = BackgroundNode::start(&node_args("1"), "unlinked-node-1");
    let unlinked_status = unlinked.exited_within(LIMIT);
    let mut sink = BackgroundNode::start(&node_args("2"), "unlinked-node-2");
    let source_status = source.exited_within(LIMIT);
    let sink_status = sink.exited_within(LIMIT);
    let _ = std::fs::remove_file(&topology);
    let _ = std::fs::remove_file(&peers);
    let all = format!(
        "node 0 {unlinked_status:?}\n{}node 1 {source_status:?}\n{}node 2 {sink_status:?}\n{}",
        unlinked.output(),
        source.output(),
        sink.output()
    );
    for status in [unlinked_status, source_status, sink_status] {
        assert!(
            status.is_some_and(|s| s.success()),
            "every node exits 0\n{all}"
        );
    }
    assert!(
        unlinked.output().contains(r#""sinks":{"local-sink":1000}"#),
        "{all}"
    );
    assert!(sink.output().contains(r#""sinks":{"sink":1000}"#), "{all}");
}

/// `--timeout` bounds the wait for the other nodes too: a node whose peers never come fails
/// when its own timeout runs out, not at the later `--rendezvous-timeout` (30 s by default).
#[test]
fn a_node_waits_for_its_peers_no_longer_than_its_timeout() {
    let topology = temp_file(
        "alone.toml",
        r#"
[cluster]
nodes = 2

[[stage]]
name = "source"
kind = "generator"
parallelism = 2
records = 10
record_size = 16

[[stage]]
name = "sink"
kind = "sink"
parallelism = 2

[[edge]]
from = "source"
to = "sink"
partitioner = "rebalance"
"#,
    );
    let rendezvous = std::env::temp_dir().join(format!(
        "fluxgate-cli-{}-alone-rendezvous",
        std::process::id()
    ));
    std::fs::create_dir_all(&rendezvous).expect("rendezvous directory created");
    // Node 1's port is free and stays unused: nobody listens there.
    let nobody = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let peers = temp_file(
        "alone.peers",
        &format!("127.0.0.1:0\n{}\n", nobody.local_addr().expect("bound")),
    );
    drop(nobody);
    let topology_arg = topology.to_str().expect("a UTF-8 temp path");
    // Well under the 30 s rendezvous timeout: a run that reaches it has ignored --timeout.
    let does_not_hang = Duration::from_secs(20);
    let by_rendezvous = fluxgate(
        &[
            "node",
            "--topology",
            topology_arg,
            "--index",
            "0",
            "--rendezvous",
            rendezvous.to_str().expect("a UTF-8 temp path"),
            "--timeout",
            "2",
        ],
        does_not_hang,
    );
    let by_peers = fluxgate(
        &[
            "node",
            "--topology",
            topology_arg,
            "--index",
            "0",
            "--peers",
            peers.to_str().expect("a UTF-8 temp path"),
            "--timeout",
            "2",
        ],
        does_not_hang,
    );
    let _ = std::fs::remove_dir_all(&rendezvous);
    let _ = std::fs::remove_file(&topology);
    let _ = std::fs::remove_file(&peers);
    assert_clean_failure(
        &by_rendezvous,
        &[
            "rendezvous: node(s) 1 did not report an address",
            "--timeout (2 s)",
        ],
    );
    assert_clean_failure(
        &by_peers,
        &[
            "node 1 at 127.0.0.1:",
            "did not accept connections",
            "--timeout (2 s)",
        ],
    );
}

/// A stall names both ends of its connections: the stalled consumer's node dumps its side,
/// and the node its producer runs on dumps the readers that feed it. The relay (node 1) stops
/// reading at the 100th record of its first channel (`--inject hold`), so the sink (node 0)
/// starves.
#[test]
fn a_stall_is_reported_by_every_node_of_the_cluster() {
    let topology = temp_file(
        "stall.toml",
        r#"
[cluster]
nodes = 2

[[stage]]
name = "source"
kind = "generator"
parallelism = 1
records = 20000
record_size = 64

[[stage]]
name = "relay"
kind = "pass-through"
parallelism = 1

[[stage]]
name = "sink"
kind = "sink"
parallelism = 1

[[edge]]
from = "source"
to = "relay"
partitioner = "forward"
buffer_timeout_ms = 0

[[edge]]
from = "relay"
to = "sink"
partitioner = "forward"
buffer_timeout_ms = 0
"#,
    );
    let run = fluxgate(
        &[
            "cluster",
            topology.to_str().expect("a UTF-8 temp path"),
            "--timeout",
            "60",
            "--stall-timeout",
            "2",
            "--inject",
            "hold",
            "--keep",
        ],
        LIMIT,
    );
    let _ = std::fs::remove_file(&topology);
    let dir = run
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("node logs and reports: "))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("the run names its directory\n{}", run.all()));
    let stderr = |node: usize| {
        std::fs::read_to_string(dir.join(format!("node-{node}.stderr"))).unwrap_or_default()
    };
    let (sink_node, relay_node) = (stderr(0), stderr(1));
    let _ = std::fs::remove_dir_all(&dir);
    let logs = format!("--- node 0\n{sink_node}--- node 1\n{relay_node}");
    assert!(!run.status.success(), "{}{logs}", run.all());
    assert!(run.stdout.contains("result: FAILED"), "{}{logs}", run.all());
    assert!(run.all().contains("stalled"), "{}{logs}", run.all());
    // The sink's side: its channel from the relay.
    assert!(
        sink_node.contains("node 0: a subtask stalled; connections:"),
        "{}{logs}",
        run.all()
    );
    // The relay's side: the reader that serves the sink, with its credit.
    let peer_dump = relay_node
        .split_once("node 1: node 0 reported a stall; connections:")
        .map(|(_, dump)| dump)
        .unwrap_or_else(|| panic!("node 1 dumps for node 0's stall\n{}{logs}", run.all()));
    assert!(peer_dump.contains("credit"), "{}{logs}", run.all());
}

#[test]
fn cluster_catches_injected_faults() {
    for (fault, expected) in [
        ("drop", "1 lost"),
        ("duplicate", "1 too many"),
        ("reorder", "records reordered"),
        ("corrupt", "not what the generator wrote"),
        ("leak", "network pool not full at exit"),
        ("late-barrier", "checkpoint 1 handed over aligned after"),
    ] {
        let run = fluxgate(
            &["cluster", EXAMPLE, "--timeout", "90", "--inject", fault],
            LIMIT,
        );
        assert!(!run.status.success(), "{fault} must fail\n{}", run.all());
        assert!(run.stdout.contains("result: FAILED"), "{}", run.all());
        assert!(
            run.stdout.contains(expected),
            "{fault}: `{expected}`\n{}",
            run.all()
        );
        assert!(!run.all().contains("panicked"), "{}", run.all());
    }
}

/// A barrier lost on its way (the hidden `--inject lose-barrier`: relay[0] never writes its
/// first one) with checkpoints aligned and unaligned in turn: its aligned checkpoint is
/// subsumed at the sinks by the next, unaligned one, as may happen legitimately there, so
/// only the per-link barrier count catches it.
#[test]
fn cluster_catches_a_barrier_lost_under_a_subsumed_checkpoint() {
    let topology = example().replace("mode = \"aligned\"", "mode = \"mixed\"");
    assert!(topology.contains("mode = \"mixed\""));
    let path = temp_file("lose-barrier.toml", &topology);
    let run = fluxgate(
        &[
            "cluster",
            path.to_str().unwrap(),
            "--timeout",
            "90",
            "--inject",
            "lose-barrier",
        ],
        LIMIT,
    );
    let _ = std::fs::remove_file(&path);
    assert!(!run.status.success(), "{}", run.all());
    assert!(run.stdout.contains("result: FAILED"), "{}", run.all());
    assert!(
        run.stdout.contains("barriers written,"),
        "the lost barrier is named\n{}",
        run.all()
    );
    assert!(!run.all().contains("panicked"), "{}", run.all());
}

#[test]
fn short_stress_verifies() {
    let run = fluxgate(
        &[
            "stress",
            "--nodes",
            "2",
            "--channels",
            "4",
            "--duration",
            "1",
            "--seed",
            "7",
            "--timeout",
            "60",
        ],
        LIMIT,
    );
    assert!(run.status.success(), "{}", run.all());
    assert!(
        run.stdout.contains("16 of 16 producer -> consumer"),
        "{}",
        run.all()
    );
    assert!(run.stdout.contains("result: OK"), "{}", run.all());
}

/// `stress` with `--kill` on top of a short run (3 nodes, 3 x 3 channels, 3 s, node 1 killed
/// 1 s in).
fn stress_with_a_kill(extra: &[&str]) -> Run {
    let mut args = vec![
        "stress",
        "--nodes",
        "3",
        "--channels",
        "3",
        "--duration",
        "3",
        "--kill",
        "1@1",
        "--seed",
        "7",
        "--timeout",
        "60",
    ];
    args.extend_from_slice(extra);
    fluxgate(&args, LIMIT)
}

#[test]
fn stress_survives_a_killed_node() {
    let run = stress_with_a_kill(&[]);
    assert!(run.status.success(), "{}", run.all());
    for expected in [
        "kill:   SIGKILL node 1 at 1.00 s",
        "faults:   node 1 (127.0.0.1:",
        "lost with it: generator[1], sink[1]",
        // sink[0] and sink[2] read from generator[1]; generator[0] and [2] write to sink[1].
        "lost:     2 of 2 surviving consumers reading from a killed node ended with ConnectionLost naming its address",
        "released: 2 of 2 surviving producers writing to a killed node saw their partition Released",
        "max detection delay",
        "none duplicated, reordered or corrupt",
        "nodes 0, 2 survived: 2 of 2 exited on their own",
        "2 of 2 with the network pool full at exit",
        "result: OK",
    ] {
        assert!(run.stdout.contains(expected), "`{expected}`\n{}", run.all());
    }
}

/// [`stress_with_a_kill`] with the hidden `--inject fault`: the run fails, saying `expected`.
fn stress_with_a_kill_catches(fault: &str, expected: &str) {
    let run = stress_with_a_kill(&["--inject", fault]);
    assert!(!run.status.success(), "must fail\n{}", run.all());
    assert!(run.stdout.contains("result: FAILED"), "{}", run.all());
    assert!(run.stdout.contains(expected), "`{expected}`\n{}", run.all());
    assert!(!run.all().contains("panicked"), "{}", run.all());
}

#[test]
fn stress_with_a_kill_still_catches_corrupt_records() {
    // The hidden --inject damages one record on sink[0], a survivor: the verification under
    // faults must not excuse it.
    stress_with_a_kill_catches("corrupt", "sink[0]: 1 records corrupt");
}

#[test]
fn stress_with_a_kill_still_catches_a_lost_record_on_a_cut_link() {
    // The hidden --inject drops the 100th record sink[0] reads from generator[0] (both on
    // node 0, which survives); its links are all cut by the kill (the one from the killed
    // node fails the sink), and a cut link was checked only to carry no more records than
    // were sent: the loss passed. Its running checksums now show that what it carried is not
    // the first records sent.
    stress_with_a_kill_catches("drop", "cut by the failure, and its first");
}

/// `--vary-credit` draws the credit options the config file leaves unset from the seed and
/// prints them; the file's stay. Seed 11 draws no exclusive buffers and one floating buffer
/// per gate, the leanest credit Flink allows, which the soak must still get through exactly.
#[test]
fn stress_with_vary_credit_draws_unset_credit_options_from_the_seed() {
    let config = temp_file(
        "credit.toml",
        "\"taskmanager.network.memory.max-buffers-per-channel\" = 10\n",
    );
    let run = fluxgate(
        &[
            "stress",
            "--nodes",
            "3",
            "--channels",
            "6",
            "--duration",
            "2",
            "--seed",
            "11",
            "--vary-credit",
            "--config",
            config.to_str().unwrap(),
            "--timeout",
            "60",
        ],
        LIMIT,
    );
    let _ = std::fs::remove_file(&config);
    assert!(run.status.success(), "{}", run.all());
    for expected in [
        "credit drawn from the seed: buffers-per-channel 0, floating-buffers-per-gate 1\n",
        "exact, checksums match",
        "result: OK",
    ] {
        assert!(run.stdout.contains(expected), "`{expected}`\n{}", run.all());
    }
}

#[test]
fn stress_refuses_bad_kill_values() {
    for (kills, expected) in [
        (
            vec!["3@1"],
            "--kill 3@1: there is no node 3 (--nodes 3: 0 to 2)",
        ),
        (
            vec!["1@3"],
            "--kill 1@3: 3 s is not within the run (--duration 3 s)",
        ),
        (vec!["1@5.5"], "is not within the run"),
        (vec!["one@1"], "--kill `one@1`: expected NODE@SECONDS"),
        (vec!["1"], "--kill `1`: expected NODE@SECONDS"),
        (vec!["1@-1"], "--kill `1@-1`: expected NODE@SECONDS"),
        (vec!["1@soon"], "expected NODE@SECONDS"),
        (vec!["1@1", "1@2"], "node 1 is killed twice"),
        (
            vec!["0@1", "1@1", "2@1"],
            "all 3 nodes would be killed; at least one must survive",
        ),
    ] {
        let mut args = vec!["stress", "--nodes", "3", "--duration", "3"];
        for kill in &kills {
            args.extend(["--kill", kill]);
        }
        let run = fluxgate(&args, LIMIT);
        assert_clean_failure(&run, &[expected]);
        assert_eq!(run.stderr.lines().count(), 1, "one line\n{}", run.all());
        assert!(run.stdout.is_empty(), "nothing started\n{}", run.all());
    }
}

/// This process's effective uid (`Uid: real effective ...` in /proc/self/status).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Why network namespaces cannot be made here (not root, no `ip`, or refused, as in many
/// containers); `None` when a probe namespace could be added and deleted.
fn netns_unavailable() -> Option<String> {
    match effective_uid() {
        Some(0) => {}
        uid => return Some(format!("not root (effective uid {uid:?})")),
    }
    let probe = format!("fluxgate-cli-probe-{}", std::process::id());
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Err(e) => Some(format!("no `ip` command: {e}")),
        Ok(out) if !out.status.success() => Some(format!(
            "`ip netns add` refused: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(_) => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).output();
            None
        }
    }
}

/// Namespaces `ip netns list` shows whose names start with `prefix`.
fn namespaces_named(prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list runs");
    assert!(out.status.success(), "ip netns list: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| name.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn stress_across_network_namespaces_verifies_and_tears_down() {
    if let Some(reason) = netns_unavailable() {
        eprintln!("SKIPPED: stress --netns: cannot create network namespaces here: {reason}");
        return;
    }
    let run = fluxgate(
        &[
            "stress",
            "--netns",
            "--nodes",
            "2",
            "--channels",
            "4",
            "--duration",
            "1",
            "--seed",
            "7",
            "--loss",
            "2",
            "--rate-limit",
            "200",
            "--timeout",
            "60",
        ],
        LIMIT,
    );
    assert!(run.status.success(), "{}", run.all());
    assert!(
        run.stdout.contains("16 of 16 producer -> consumer"),
        "{}",
        run.all()
    );
    assert!(run.stdout.contains("result: OK"), "{}", run.all());
    // The loss is applied by some mechanism, or its absence is said loudly.
    let impair = run
        .stdout
        .lines()
        .find(|l| l.starts_with("impair: "))
        .unwrap_or_else(|| panic!("an `impair:` line\n{}", run.all()));
    assert!(
        impair.contains("loss") || run.stderr.contains("NOT APPLIED"),
        "{}",
        run.all()
    );
    let prefix = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("netns:  namespaces "))
        .and_then(|rest| rest.split_once("hub "))
        .map(|(prefix, _)| prefix.to_string())
        .unwrap_or_else(|| panic!("a `netns:` line naming the prefix\n{}", run.all()));
    assert!(
        prefix.starts_with("fluxgate-") && prefix.ends_with('-'),
        "{prefix}"
    );
    assert_eq!(
        namespaces_named(&prefix),
        Vec::<String>::new(),
        "all deleted"
    );
    let secret = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("auth:   on, a random secret in "))
        .and_then(|rest| rest.split_once(" (0600"))
        .map(|(path, _)| PathBuf::from(path))
        .unwrap_or_else(|| panic!("an `auth:` line naming the secret file\n{}", run.all()));
    assert!(!secret.exists(), "{} removed", secret.display());
}

#[test]
fn stress_netns_without_root_or_ip_fails_clearly() {
    let args = ["stress", "--netns", "--nodes", "2", "--duration", "1"];
    // No `ip` on PATH: as root, that is the error; otherwise root comes first.
    let mut without_ip = Command::new(env!("CARGO_BIN_EXE_fluxgate"));
    without_ip.env("PATH", "");
    let run = fluxgate_with(without_ip, &args, LIMIT);
    if effective_uid() == Some(0) {
        assert_clean_failure(&run, &["--netns needs the `ip` command"]);
    } else {
        assert_clean_failure(&run, &["--netns needs root"]);
    }
    assert_eq!(run.stderr.lines().count(), 1, "one line\n{}", run.all());

    // Not root: run directly, or as root drop to nobody through setpriv (when it exists).
    let as_user = if effective_uid() != Some(0) {
        Some(Command::new(env!("CARGO_BIN_EXE_fluxgate")))
    } else if Command::new("setpriv").arg("--version").output().is_ok() {
        let mut command = Command::new("setpriv");
        command
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_fluxgate"));
        Some(command)
    } else {
        None
    };
    match as_user {
        Some(command) => {
            let run = fluxgate_with(command, &args, LIMIT);
            assert_clean_failure(&run, &["--netns needs root", "uid"]);
            assert_eq!(run.stderr.lines().count(), 1, "one line\n{}", run.all());
        }
        None => eprintln!("SKIPPED: stress --netns as non-root: running as root without setpriv"),
    }
}

#[test]
fn bench_prints_lines_with_the_baseline() {
    let run = fluxgate(
        &[
            "bench",
            "--format",
            "lines",
            "--duration",
            "0.3",
            "--latency-duration",
            "0.2",
            "--rate",
            "2000",
        ],
        LIMIT,
    );
    assert!(run.status.success(), "{}", run.all());
    let names: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    for name in ["records_per_sec", "baseline_records_per_sec"] {
        assert!(names.contains(&name), "a `{name}` line\n{}", run.all());
    }
    for line in run.stdout.lines().filter(|l| l.contains("records_per_sec")) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert!(
            fields.len() == 3 && fields[1].parse::<f64>().is_ok_and(|v| v > 0.0),
            "`name value unit` with a positive value: {line:?}\n{}",
            run.all()
        );
    }
}

#[test]
fn the_hgrm_file_reads_back_as_the_printed_percentiles() {
    let path = std::env::temp_dir().join(format!("fluxgate-cli-{}.hgrm", std::process::id()));
    let path_text = path.to_str().expect("utf-8 temp path").to_owned();
    let run = fluxgate(
        &[
            "bench",
            "--format",
            "lines",
            "--duration",
            "0.2",
            "--latency-duration",
            "0.5",
            "--rate",
            "2000",
            "--no-baseline",
            "--hgrm",
            &path_text,
        ],
        LIMIT,
    );
    assert!(run.status.success(), "{}", run.all());
    let printed = |name: &str| -> f64 {
        run.stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no `{name}` line\n{}", run.all()))
    };
    let hgrm = std::fs::read_to_string(&path).expect("the .hgrm file");
    let _ = std::fs::remove_file(&path);
    // Rows: value, percentile, total count[, 1/(1-percentile)]; header and `#[` footer skipped.
    let rows: Vec<(f64, f64, u64)> = hgrm
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            Some((
                fields.first()?.parse().ok()?,
                fields.get(1)?.parse().ok()?,
                fields.get(2)?.parse().ok()?,
            ))
        })
        .collect();
    assert!(rows.len() > 10, "percentile rows\n{hgrm}");
    assert!(rows
        .windows(2)
        .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1 && w[0].2 <= w[1].2));
    let total = rows.last().expect("rows").2;
    // The value at quantile q is the ceil(q × total)-th sample's. The rows sample the
    // distribution at percentile ticks, so that sample lies after the last row that counts
    // fewer and at or before the first row that counts as many: the printed value must fall
    // in that bracket (a steep tail under load makes the rows far apart there).
    let bracket = |q: f64| {
        let target = ((q * total as f64).ceil() as u64).max(1);
        let at = rows
            .iter()
            .position(|r| r.2 >= target)
            .expect("a row counting the target");
        (if at == 0 { 0.0 } else { rows[at - 1].0 }, rows[at].0)
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 0.01 * b.max(1.0);
    let within = |(low, high): (f64, f64), value: f64| {
        (low <= value || close(low, value)) && (value <= high || close(high, value))
    };
    assert!(
        within(bracket(0.5), printed("latency_p50_us")),
        "p50\n{hgrm}\n{}",
        run.all()
    );
    assert!(
        within(bracket(0.99), printed("latency_p99_us")),
        "p99\n{hgrm}\n{}",
        run.all()
    );
    let last = rows.last().expect("rows");
    assert_eq!(last.1, 1.0);
    assert!(close(last.0, printed("latency_max_us")), "max\n{hgrm}");
    assert!(hgrm.contains(&format!("Total count    = {:>12}", last.2)));
}

/// A short bench run: `--duration 0.2 --latency-duration 0.2 --rate 2000` plus `extra`.
fn short_bench(extra: &[&str]) -> Run {
    let mut args = vec![
        "bench",
        "--duration",
        "0.2",
        "--latency-duration",
        "0.2",
        "--rate",
        "2000",
    ];
    args.extend_from_slice(extra);
    fluxgate(&args, LIMIT)
}

#[test]
fn bench_moves_every_record_in_batches_and_one_per_call() {
    // The bench fails a run whose consumers read another count than the producers emitted.
    for (size, local, per_record) in [
        ("0", true, false),
        ("8", true, false),
        ("300", true, false),
        ("8", true, true),
        ("8", false, false),
        ("8", false, true),
    ] {
        let mut args = vec![
            "bench",
            "--format",
            "lines",
            "--duration",
            "0.2",
            "--rate",
            "0",
            "--no-baseline",
            "--record-size",
            size,
        ];
        args.extend(local.then_some("--local"));
        args.extend(per_record.then_some("--per-record"));
        let run = fluxgate(&args, LIMIT);
        assert!(run.status.success(), "{args:?}\n{}", run.all());
        assert!(
            run.stdout
                .lines()
                .any(|l| l.starts_with("records_per_sec ")),
            "{args:?}\n{}",
            run.all()
        );
    }
}

#[test]
fn bench_plots_latency_by_percentile_to_svg() {
    let path = std::env::temp_dir().join(format!("fluxgate-cli-{}.svg", std::process::id()));
    let path_text = path.to_str().expect("utf-8 temp path").to_owned();
    let run = short_bench(&["--format", "lines", "--plot", &path_text]);
    assert!(run.status.success(), "{}", run.all());
    let svg = std::fs::read_to_string(&path).expect("the .svg file");
    let _ = std::fs::remove_file(&path);
    assert!(svg.contains("<svg"), "an SVG document\n{svg}");
    // One line per series: the engine's and the baseline's.
    let lines = svg.matches("<polyline").count() + svg.matches("<path").count();
    assert!(lines >= 2, "a line per histogram\n{svg}");
    for label in ["fluxgate", "raw TCP baseline", "99.9%", "latency"] {
        assert!(svg.contains(label), "`{label}` in the plot\n{svg}");
    }
}

#[test]
fn bench_plot_without_a_latency_run_fails_clearly() {
    let run = fluxgate(&["bench", "--rate", "0", "--plot", "never.svg"], LIMIT);
    assert_clean_failure(&run, &["--plot needs the latency run"]);
}

#[test]
fn bench_prints_metric_snapshots_with_flinks_names() {
    let run = short_bench(&["--format", "lines", "--no-baseline", "--metrics"]);
    assert!(run.status.success(), "{}", run.all());
    let value = |name: &str| -> f64 {
        run.stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no `{name}` line\n{}", run.all()))
    };
    // Every record the producer wrote was read: the gate's bytes cover the partition's.
    let records = value("partition.0.numRecordsOut");
    assert!(records > 0.0, "{}", run.all());
    assert!(value("partition.0.numBuffersOut") > 0.0, "{}", run.all());
    assert!(
        value("gate.0.numBytesIn") >= value("partition.0.numBytesOut"),
        "{}",
        run.all()
    );
    assert!(value("gate.0.numBuffersIn") > 0.0, "{}", run.all());
    let usage = value("partition.0.outPoolUsage");
    assert!((0.0..=1.0).contains(&usage), "{}", run.all());
    value("partition.0.accumulatedBackPressuredTimeMs");
    value("gate.0.inPoolUsage");
    value("gate.0.accumulatedIdleTimeMs");
    // The default run is remote: all of the gate's input came over the wire, and it was all
    // read when the snapshots were taken.
    assert_eq!(
        value("gate.0.numBytesInRemote"),
        value("gate.0.numBytesIn"),
        "{}",
        run.all()
    );
    assert_eq!(value("gate.0.numBuffersInLocal"), 0.0, "{}", run.all());
    assert_eq!(value("gate.0.inputQueueLength"), 0.0, "{}", run.all());
    // All read: no segment of the gate holds data any more, of either kind.
    assert_eq!(
        value("gate.0.inputExclusiveBuffersUsage"),
        0.0,
        "{}",
        run.all()
    );
    assert_eq!(
        value("gate.0.inputFloatingBuffersUsage"),
        0.0,
        "{}",
        run.all()
    );
    // Taken by the producer as it finishes: what its consumer had still to take.
    value("partition.0.outputQueueLength");
    assert!(run.stdout.contains("records_per_sec "), "{}", run.all());

    let run = short_bench(&["--format", "json", "--no-baseline", "--metrics"]);
    assert!(run.status.success(), "{}", run.all());
    assert_eq!(
        run.stdout.lines().count(),
        1,
        "one JSON object\n{}",
        run.all()
    );
    for name in [
        "\"metrics\":{",
        "\"partitions\":[{",
        "\"numRecordsOut\":",
        "\"gates\":[{",
        "\"numBuffersIn\":",
    ] {
        assert!(run.stdout.contains(name), "`{name}`\n{}", run.all());
    }
}

#[test]
fn bench_applies_a_config_file_and_flags_win() {
    let path = temp_file(
        "bench-config.toml",
        "# Flink option names\n\"taskmanager.memory.segment-size\" = \"16kb\"\n\
         [taskmanager.network.memory]\nbuffers-per-channel = 4\n",
    );
    let path_text = path.to_str().unwrap().to_owned();
    let run = short_bench(&["--no-baseline", "--config", &path_text]);
    assert!(run.status.success(), "{}", run.all());
    assert!(run.stdout.contains("16384 B segments"), "{}", run.all());
    assert!(
        !run.stdout.contains("busy-poll"),
        "I/O threads do not busy-poll unless asked\n{}",
        run.all()
    );
    let run = short_bench(&[
        "--no-baseline",
        "--config",
        &path_text,
        "--segment-size",
        "8192",
    ]);
    assert!(run.status.success(), "{}", run.all());
    assert!(run.stdout.contains("8192 B segments"), "{}", run.all());
    let _ = std::fs::remove_file(path);
}

#[test]
fn bench_busy_polls_its_io_threads_when_asked() {
    let run = short_bench(&["--no-baseline", "--busy-poll-us", "300"]);
    assert!(run.status.success(), "{}", run.all());
    assert!(
        run.stdout
            .contains("I/O threads busy-poll 300 µs before they sleep"),
        "{}",
        run.all()
    );
    assert!(run.stdout.contains("latency_p50_us"), "{}", run.all());
    let run = fluxgate(&["bench", "--busy-poll-us", "1000001"], LIMIT);
    assert_clean_failure(
        &run,
        &[
            "--busy-poll-us",
            "fluxgate.network.io-thread.busy-poll-us",
            "at most 1000000",
        ],
    );
}

#[test]
fn bench_pins_its_two_sides_to_the_cpus_asked_for() {
    // CPU 0 for both sides: there on every machine.
    let run = short_bench(&["--pin-cpus", "0,0"]);
    assert!(run.status.success(), "{}", run.all());
    assert!(
        run.stdout.contains("pinned: producer side"),
        "{}",
        run.all()
    );
    assert!(run.stdout.contains("latency_p50_us"), "{}", run.all());
    // A CPU the machine does not have: pinning is attempted, and refused clearly.
    let run = short_bench(&["--pin-cpus", "0,1000"]);
    assert_clean_failure(&run, &["CPU 1000"]);
    let run = fluxgate(&["bench", "--local", "--pin-cpus", "0,1"], LIMIT);
    assert_clean_failure(&run, &["--pin-cpus", "--local"]);
    // A malformed value is a usage error (clap's exit status 2).
    let run = fluxgate(&["bench", "--pin-cpus", "0"], LIMIT);
    assert_eq!(run.status.code(), Some(2), "{}", run.all());
    assert!(run.stderr.contains("is not `P,C`"), "{}", run.all());
}

#[test]
fn bench_and_cluster_refuse_durations_and_rates_they_cannot_run() {
    let cases: [(&[&str], &str); 5] = [
        (&["bench", "--latency-duration=-1"], "--latency-duration -1"),
        (&["bench", "--duration", "NaN"], "--duration NaN"),
        (&["bench", "--rate", "2000000000"], "--rate 2000000000"),
        (
            &["bench", "--rate", "0", "--hgrm", "never.hgrm"],
            "--hgrm needs",
        ),
        (
            &[
                "cluster",
                "examples/topologies/three-node.toml",
                "--timeout",
                "1e19",
            ],
            "--timeout 10000000000000000000",
        ),
    ];
    for (args, message) in cases {
        let run = fluxgate(args, LIMIT);
        assert_clean_failure(&run, &[message]);
    }
}

#[test]
fn an_interrupted_stress_run_stops_its_nodes_and_removes_its_directory() {
    let _turn = HEAVY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let child = Command::new(env!("CARGO_BIN_EXE_fluxgate"))
        .args([
            "stress",
            "--nodes",
            "2",
            "--channels",
            "2",
            "--duration",
            "60",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fluxgate starts");
    let mut child = child;
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped");
    let (lines_tx, lines) = std::sync::mpsc::channel();
    // Ends with the child's stdout.
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    // Its first per-second line: the nodes run and write into the run's directory.
    let mut running = false;
    for _ in 0..5 {
        match lines.recv_timeout(LIMIT) {
            Ok(line) if line.contains("records/s") => {
                running = true;
                break;
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    if !running {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the stress run never reported progress");
    }
    let prefix = format!("fluxgate-cluster-{pid}-");
    let dirs = || {
        std::fs::read_dir(std::env::temp_dir())
            .expect("the temp dir")
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with(&prefix))
            .count()
    };
    assert_eq!(dirs(), 1, "the run's directory exists while it runs");
    let sent = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(sent.success());
    let mut status = None;
    // Bounded by count and LIMIT: the interrupted run ends within a second or two.
    let deadline = std::time::Instant::now() + LIMIT;
    while status.is_none() && std::time::Instant::now() < deadline {
        status = child.try_wait().expect("the child can be waited for");
        if status.is_none() {
            // Not a spin: the child needs the vCPU to end.
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the interrupted run did not end");
    };
    assert!(!status.success(), "an interrupted run fails");
    assert_eq!(dirs(), 0, "the run's directory is removed");
}

#[test]
fn the_baseline_measures_records_longer_than_one_read() {
    // 64 KiB records: each arrives in several reads of the baseline's 32 KiB buffer.
    let run = short_bench(&["--record-size", "65536", "--format", "lines"]);
    assert!(run.status.success(), "{}", run.all());
    let p50 = run
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("baseline_latency_p50_us "))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("a baseline p50\n{}", run.all()));
    assert!(p50 > 0.0, "measured, not an empty histogram\n{}", run.all());
}

#[test]
fn bench_config_file_errors_are_clear() {
    let cases = [
        (
            "\"taskmanager.memory.segmentsize\" = \"32kb\"\n",
            vec![
                "config file",
                "unknown option `taskmanager.memory.segmentsize`",
                "known options: taskmanager.memory.segment-size",
            ],
        ),
        (
            "\"taskmanager.memory.segment-size\" = \"lots\"\n",
            vec!["invalid value `lots` for `taskmanager.memory.segment-size`"],
        ),
        (
            "\"taskmanager.memory.segment-size\" = 1.5\n",
            vec!["expected a string, an integer or a boolean, got float"],
        ),
        ("[taskmanager\n", vec!["TOML parse error at line 1"]),
    ];
    for (i, (text, expected)) in cases.iter().enumerate() {
        let path = temp_file(&format!("bench-bad-{i}.toml"), text);
        let run = fluxgate(&["bench", "--config", path.to_str().unwrap()], LIMIT);
        assert_clean_failure(&run, expected);
        let _ = std::fs::remove_file(path);
    }
    let run = fluxgate(&["bench", "--config", "no/such/config.toml"], LIMIT);
    assert_clean_failure(&run, &["cannot read config file `no/such/config.toml`"]);
}

#[test]
fn a_long_bench_without_a_terminal_draws_no_progress_bar() {
    // 2.2 s planned: a bar on a terminal; stderr is a pipe here, so nothing.
    let run = fluxgate(
        &[
            "bench",
            "--local",
            "--duration",
            "2.2",
            "--rate",
            "0",
            "--no-baseline",
        ],
        LIMIT,
    );
    assert!(run.status.success(), "{}", run.all());
    assert!(!run.stderr.contains("throughput"), "{}", run.all());
    assert!(!run.stderr.contains("=>"), "{}", run.all());
}

#[test]
fn the_remote_bench_counts_across_its_two_processes() {
    // The producer process reports its partitions' numRecordsOut; this process counts what
    // its gates read. Every emitted record arrives exactly once.
    let run = short_bench(&[
        "--no-baseline",
        "--format",
        "json",
        "--metrics",
        "--producers",
        "2",
    ]);
    assert!(run.status.success(), "{}", run.all());
    let report: serde_json::Value =
        serde_json::from_str(run.stdout.trim()).expect("one JSON object");
    let consumed = report["records"].as_u64().expect("records");
    let partitions = report["metrics"]["partitions"]
        .as_array()
        .expect("partition metrics from the producer process");
    assert_eq!(partitions.len(), 2, "{}", run.all());
    let produced: u64 = partitions
        .iter()
        .map(|p| p["numRecordsOut"].as_u64().expect("numRecordsOut"))
        .sum();
    assert!(consumed > 0, "{}", run.all());
    assert_eq!(produced, consumed, "{}", run.all());
}

#[test]
fn a_producer_process_left_alone_exits_with_an_error() {
    // What `bench` starts, run without its parent: stdin closes before `go`.
    let run = fluxgate(
        &["bench", "--producer-process", "throughput", "--no-baseline"],
        LIMIT,
    );
    assert!(run.stdout.starts_with("ready 127.0.0.1:"), "{}", run.all());
    assert_clean_failure(&run, &["went away before the run"]);
}

/// A half-second stress run of 2 nodes and 2 channels with `seed` and the config file at
/// `config`.
fn short_stress_with_config<'a>(seed: &'a str, config: &'a str) -> Vec<&'a str> {
    vec![
        "stress",
        "--nodes",
        "2",
        "--channels",
        "2",
        "--duration",
        "0.5",
        "--seed",
        seed,
        "--timeout",
        "60",
        "--config",
        config,
    ]
}

#[test]
fn stress_takes_a_config_file_and_flags_win() {
    let config = temp_file(
        "stress-config.toml",
        "\"taskmanager.memory.segment-size\" = \"16kb\"\n\
         \"taskmanager.network.memory.buffers-per-channel\" = 3\n",
    );
    let config = config.to_str().expect("utf-8 path");
    let short = short_stress_with_config("3", config);
    let run = fluxgate(&short, LIMIT);
    assert!(run.status.success(), "{}", run.all());
    assert!(run.stdout.contains("segments 16 KiB"), "{}", run.all());
    assert!(run.stdout.contains("result: OK"), "{}", run.all());
    let mut flagged = short.to_vec();
    flagged.extend(["--segment-size", "4kb"]);
    let run = fluxgate(&flagged, LIMIT);
    assert!(run.status.success(), "{}", run.all());
    assert!(run.stdout.contains("segments 4 KiB"), "{}", run.all());
}

/// Stress checks a config file together with what it sets itself (8 KiB segments unless
/// told otherwise) and all at once: a frame size that fits its segments but not the library's
/// default 32 KiB ones is taken. It was refused, checked alone against the default first.
#[test]
fn stress_checks_a_config_file_against_the_segments_it_runs() {
    let config = temp_file(
        "stress-frame.toml",
        "\"fluxgate.network.max-frame-size\" = \"16kb\"\n",
    );
    let run = fluxgate(
        &short_stress_with_config("5", config.to_str().expect("utf-8 path")),
        LIMIT,
    );
    let _ = std::fs::remove_file(&config);
    assert!(run.status.success(), "{}", run.all());
    assert!(run.stdout.contains("segments 8 KiB"), "{}", run.all());
    assert!(run.stdout.contains("result: OK"), "{}", run.all());
}

/// Sizes the tools would allocate by are refused before they allocate: a record above
/// `fluxgate.record.max-size` (the bench's batch of them aborted the process), and more
/// stress channels than a stage may have.
#[test]
fn tools_refuse_sizes_beyond_their_bounds_before_allocating() {
    let run = fluxgate(
        &["bench", "--record-size", "1000000000000", "--no-baseline"],
        LIMIT,
    );
    assert_clean_failure(
        &run,
        &["--record-size 1000000000000: above the largest record, fluxgate.record.max-size"],
    );
    let run = fluxgate(&["stress", "--channels", "5000"], LIMIT);
    assert_clean_failure(&run, &["--channels 5000: at most 4096"]);
}

#[test]
fn stress_config_file_errors_are_clear() {
    let bad = temp_file(
        "stress-bad.toml",
        "\"taskmanager.memory.segmentsize\" = \"16kb\"\n",
    );
    let run = fluxgate(
        &["stress", "--config", bad.to_str().expect("utf-8 path")],
        LIMIT,
    );
    assert_clean_failure(&run, &["unknown option `taskmanager.memory.segmentsize`"]);
}
