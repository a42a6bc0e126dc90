//! The `fluxgate` binary as a user runs it: `cluster` on the example topology, bad inputs
//! (clear messages, non-zero exit, no panic), faults the verification must catch, a short
//! `stress`, and `bench --format lines`. Every run is bounded: a child still running at its
//! deadline is killed and the test fails.

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

/// Runs `fluxgate args` from the crate root; kills it at `limit` (and fails the test).
fn fluxgate(args: &[&str], limit: Duration) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fluxgate"))
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
    let run = fluxgate(&["cluster", EXAMPLE, "--timeout", "90"], LIMIT);
    assert!(run.status.success(), "{}", run.all());
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

#[test]
fn cluster_catches_injected_faults() {
    for (fault, expected) in [
        ("drop", "1 lost"),
        ("duplicate", "1 too many"),
        ("reorder", "records reordered"),
        ("corrupt", "not what the generator wrote"),
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
    let at = |q: f64| {
        rows.iter()
            .find(|r| r.1 >= q)
            .expect("a row at or past q")
            .0
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 0.01 * b.max(1.0);
    assert!(
        close(at(0.5), printed("latency_p50_us")),
        "p50\n{hgrm}\n{}",
        run.all()
    );
    assert!(
        close(at(0.99), printed("latency_p99_us")),
        "p99\n{hgrm}\n{}",
        run.all()
    );
    let last = rows.last().expect("rows");
    assert_eq!(last.1, 1.0);
    assert!(close(last.0, printed("latency_max_us")), "max\n{hgrm}");
    assert!(hgrm.contains(&format!("Total count    = {:>12}", last.2)));
}
