//! The io_uring driver's send path: zero-copy sends only off loopback (checked on loopback
//! and over a veth pair between two network namespaces), registered files in use and their
//! slots reused. Every test skips loudly where the kernel refuses io_uring; the namespace test
//! also where network namespaces cannot be made (not root, no `ip`, a container).
//!
//! The namespace test runs each environment in its own namespace: this test binary again,
//! under `ip netns exec`, on the ignored `zc_child` test, which reads its role from the
//! environment (the pattern of `tests/faults.rs`).

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use fluxgate::gate::{ConsumedSubpartition, ReaderItem, RecordReader};
use fluxgate::io::{DriverStats, Transport};
use fluxgate::partition::{BufferTimeout, RecordWriter, ResultPartitionId, RoundRobinSelector};
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

const LONG: Duration = Duration::from_secs(20);

/// Environment variables of the child process (`zc_child`).
const ROLE: &str = "FLUXGATE_ZC_ROLE";
const ADDR: &str = "FLUXGATE_ZC_ADDR";
const MODE: &str = "FLUXGATE_ZC_MODE";
const RECORDS: &str = "FLUXGATE_ZC_RECORDS";

/// An io_uring environment with 32 KiB segments bound to `bind`.
fn env(node: u128, bind: SocketAddr, options: &[(&str, &str)]) -> ShuffleEnvironment {
    let mut network = NetworkConfig::default();
    network
        .set("taskmanager.memory.segment-size", "32kb")
        .unwrap();
    network
        .set("taskmanager.memory.network.max", "16mb")
        .unwrap();
    network.set("fluxgate.memory.arena-size", "8mb").unwrap();
    network.set("fluxgate.security.auth", "off").unwrap();
    for (key, value) in options {
        network.set(key, value).unwrap();
    }
    let env = ShuffleEnvironment::start(EnvConfig {
        network,
        node,
        bind,
        transport: Transport::Uring,
        ..EnvConfig::default()
    })
    .unwrap();
    assert_eq!(env.transport(), Transport::Uring);
    env
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn pid(partition: u64) -> ResultPartitionId {
    ResultPartitionId {
        partition,
        producer: 3,
    }
}

/// Record `seq`: mostly large (so whole 32 KiB segments go out), its bytes named by `seq`.
fn record(seq: u64) -> Vec<u8> {
    let len = match seq % 5 {
        0 => 40_000,
        1 => 17,
        _ => 9_000 + (seq.wrapping_mul(2654435761) % 7_000) as usize,
    };
    let mut bytes = Vec::with_capacity(8 + len);
    bytes.extend_from_slice(&seq.to_be_bytes());
    bytes.extend((0..len).map(|i| (seq as usize).wrapping_mul(31).wrapping_add(i) as u8));
    bytes
}

fn stats(env: &ShuffleEnvironment) -> DriverStats {
    env.driver_stats_within(LONG)
        .expect("the I/O thread answers")
}

fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + LONG;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(2));
    }
}

/// Writes `records` records into partition `pid(0)` of `env` (one subpartition).
fn produce(env: &ShuffleEnvironment, records: u64) -> thread::JoinHandle<()> {
    let partition = env.create_partition(pid(0), 1).unwrap();
    thread::spawn(move || {
        let mut writer = RecordWriter::new(
            partition,
            RoundRobinSelector::default(),
            BufferTimeout::from_millis(5),
        );
        for seq in 0..records {
            writer.emit(&record(seq)[..]).unwrap();
        }
        writer.finish().unwrap();
    })
}

/// Reads partition `pid(0)` from `producer` and checks every record exactly, in order; the
/// number of records read.
fn consume(env: &ShuffleEnvironment, producer: SocketAddr) -> u64 {
    let gate = env
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: pid(0),
                subpartition: 0,
            },
            location: ProducerLocation::Remote(producer),
        }])
        .unwrap();
    let mut reader = RecordReader::new(gate, 1 << 20);
    let mut next = 0u64;
    let mut ends = 0;
    while let Some(item) = reader.next_timeout(LONG).unwrap() {
        match item {
            ReaderItem::Record { bytes, .. } => {
                assert_eq!(
                    bytes,
                    &record(next)[..],
                    "record {next} intact and in order"
                );
                next += 1;
            }
            ReaderItem::Event { .. } => ends += 1,
        }
    }
    assert_eq!(ends, 1, "one EndOfPartition");
    next
}

#[test]
fn a_loopback_exchange_never_sends_zero_copy() {
    if common::skip_without_uring("a_loopback_exchange_never_sends_zero_copy") {
        return;
    }
    let producer_env = env(1, loopback(), &[]);
    let consumer_env = env(2, loopback(), &[]);
    let records = 2_000;
    let producer = produce(&producer_env, records);
    assert_eq!(consume(&consumer_env, producer_env.local_addr()), records);
    producer.join().unwrap();
    assert!(common::pool_full(&producer_env) && common::pool_full(&consumer_env));
    for env in [&producer_env, &consumer_env] {
        let stats = stats(env);
        eprintln!("{}: {stats:?}", env.local_addr());
        assert_eq!(stats.zc_sends, 0, "no zero-copy send on loopback");
        assert_eq!(stats.zc_notifications, 0);
        assert!(stats.writes > 0);
    }
}

/// `records` records of partition `pid(partition)` from `producer` to `consumer`, checked.
fn small_exchange(producer: &ShuffleEnvironment, consumer: &ShuffleEnvironment, partition: u64) {
    let records = 20;
    let output = producer.create_partition(pid(partition), 1).unwrap();
    let writer = thread::spawn(move || {
        let mut writer =
            RecordWriter::new(output, RoundRobinSelector::default(), BufferTimeout::Never);
        for seq in 0..records {
            writer.emit(&record(seq)[..]).unwrap();
        }
        writer.finish().unwrap();
    });
    let gate = consumer
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: pid(partition),
                subpartition: 0,
            },
            location: ProducerLocation::Remote(producer.local_addr()),
        }])
        .unwrap();
    let mut reader = RecordReader::new(gate, 1 << 20);
    let mut seq = 0;
    while let Some(item) = reader.next_timeout(LONG).unwrap() {
        if let ReaderItem::Record { bytes, .. } = item {
            assert_eq!(bytes, &record(seq)[..]);
            seq += 1;
        }
    }
    assert_eq!(seq, records);
    writer.join().unwrap();
}

#[test]
fn registered_files_are_used_and_their_slots_reused() {
    let test = "registered_files_are_used_and_their_slots_reused";
    if common::skip_without_uring(test) {
        return;
    }
    // Connections stay open while both environments live: each round pairs a long-lived
    // environment with a short-lived one, whose end closes the connection on both sides.
    let small = [("taskmanager.memory.network.max", "2mb")];
    let producer_env = env(1, loopback(), &small);
    let consumer_env = env(2, loopback(), &small);
    if stats(&producer_env).file_table_size == 0 {
        eprintln!("SKIPPED: {test}: the kernel refused a registered-file table (logged)");
        return;
    }
    let rounds = 25u64;
    for round in 0..rounds {
        let consumer = env(3, loopback(), &small);
        small_exchange(&producer_env, &consumer, 2 * round);
        assert!(
            common::pool_full(&consumer),
            "round {round}: the short-lived consumer leaked"
        );
        drop(consumer);
        let producer = env(4, loopback(), &small);
        small_exchange(&producer, &consumer_env, 2 * round + 1);
        assert!(
            common::pool_full(&producer),
            "round {round}: the short-lived producer leaked"
        );
        drop(producer);
        // The long-lived ends saw the connections close and cleared their slots.
        wait_until("the long-lived ends to close their connections", || {
            stats(&producer_env).file_slots_in_use == 0
                && stats(&consumer_env).file_slots_in_use == 0
        });
    }
    assert!(common::pool_full(&producer_env) && common::pool_full(&consumer_env));
    for env in [&producer_env, &consumer_env] {
        let stats = stats(env);
        eprintln!("{}: {stats:?}", env.local_addr());
        assert_eq!(stats.files_registered, rounds, "a file slot per connection");
        assert_eq!(
            stats.file_slots_high_water, 1,
            "the slot of a closed connection is reused: {stats:?}"
        );
        assert!(stats.fixed_file_ops > 0);
        assert_eq!(
            stats.plain_fd_ops, 0,
            "every socket operation on a registered file"
        );
    }
}

#[test]
fn forced_zero_copy_sends_on_loopback_deliver_every_record_and_segment() {
    let test = "forced_zero_copy_sends_on_loopback_deliver_every_record_and_segment";
    if common::skip_without_uring(test) {
        return;
    }
    if !stats(&env(9, loopback(), &[])).zc_available {
        eprintln!("SKIPPED: {test}: the kernel has no zero-copy send (logged)");
        return;
    }
    // `always`: zero-copy on loopback too and never switched off, so many sends and
    // notifications cross (the kernel copies every one of them on loopback).
    let always = [("fluxgate.network.zero-copy-send", "always")];
    let producer_env = env(1, loopback(), &always);
    let consumer_env = env(2, loopback(), &always);
    let records = 3_000;
    let producer = produce(&producer_env, records);
    assert_eq!(consume(&consumer_env, producer_env.local_addr()), records);
    producer.join().unwrap();
    assert!(common::pool_full(&producer_env) && common::pool_full(&consumer_env));
    let stats = stats(&producer_env);
    eprintln!("{stats:?}");
    assert!(stats.zc_sends > 10, "{stats:?}");
    assert_eq!(
        stats.zc_notifications, stats.zc_sends,
        "every send notified"
    );
    assert_eq!(stats.zc_switched_off, 0, "`always` never switches off");
    assert_eq!(stats.zc_orphaned_segments, 0);
}

#[test]
fn a_consumer_gone_mid_stream_leaves_no_segment_behind_zero_copy_sends() {
    let test = "a_consumer_gone_mid_stream_leaves_no_segment_behind_zero_copy_sends";
    if common::skip_without_uring(test) {
        return;
    }
    let always = [("fluxgate.network.zero-copy-send", "always")];
    let producer_env = env(1, loopback(), &always);
    if !stats(&producer_env).zc_available {
        eprintln!("SKIPPED: {test}: the kernel has no zero-copy send (logged)");
        return;
    }
    for round in 0..5 {
        let consumer_env = env(2, loopback(), &always);
        let partition = producer_env.create_partition(pid(round), 1).unwrap();
        let writer = thread::spawn(move || {
            let mut writer = RecordWriter::new(
                partition,
                RoundRobinSelector::default(),
                BufferTimeout::from_millis(1),
            );
            // Ends with an error once the consumer is gone (its view released).
            for seq in 0..1_000_000 {
                if writer.emit(&record(seq)[..]).is_err() {
                    return;
                }
            }
        });
        let gate = consumer_env
            .create_gate(&[ChannelDescriptor {
                consumed: ConsumedSubpartition {
                    partition: pid(round),
                    subpartition: 0,
                },
                location: ProducerLocation::Remote(producer_env.local_addr()),
            }])
            .unwrap();
        let mut reader = RecordReader::new(gate, 1 << 20);
        for seq in 0..200 {
            match reader.next_timeout(LONG).unwrap() {
                Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, &record(seq)[..]),
                other => panic!("record {seq}: {other:?}"),
            }
        }
        // Gone with data in flight.
        drop(reader);
        drop(consumer_env);
        let _ = producer_env.partition_manager().release(pid(round));
        writer.join().unwrap();
    }
    assert!(
        common::pool_full(&producer_env),
        "every held segment returned"
    );
    let stats = stats(&producer_env);
    eprintln!("{stats:?}");
    assert!(stats.zc_sends > 0);
    assert_eq!(stats.zc_notifications, stats.zc_sends);
    assert_eq!(stats.zc_orphaned_segments, 0);
}

// ---- across network namespaces -------------------------------------------------------------

/// This process's effective uid (`Uid: real effective ...` in /proc/self/status).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("no `ip` command: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces joined by a veth pair (10.77.0.1 in `a`, 10.77.0.2 in `b`); both deleted
/// (with the pair) on drop. Nothing is added to this process's namespace.
struct VethPair {
    a: String,
    b: String,
}

impl VethPair {
    const A: [u8; 4] = [10, 77, 0, 1];
    const B: [u8; 4] = [10, 77, 0, 2];

    /// `Err` says why namespaces cannot be made here.
    fn create() -> Result<Self, String> {
        match effective_uid() {
            Some(0) => {}
            uid => return Err(format!("not root (effective uid {uid:?})")),
        }
        let tag = format!("fluxgate-zc-{}-{}", std::process::id(), rand_suffix());
        let pair = VethPair {
            a: format!("{tag}-a"),
            b: format!("{tag}-b"),
        };
        ip(&["netns", "add", &pair.a])?;
        // From here on a failure drops `pair`, which deletes what exists.
        ip(&["netns", "add", &pair.b])?;
        ip(&[
            "-n", &pair.a, "link", "add", "zc0", "type", "veth", "peer", "name", "zc0", "netns",
            &pair.b,
        ])?;
        for (ns, addr) in [(&pair.a, "10.77.0.1/24"), (&pair.b, "10.77.0.2/24")] {
            ip(&["-n", ns, "addr", "add", addr, "dev", "zc0"])?;
            ip(&["-n", ns, "link", "set", "zc0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        % 100_000
}

/// This test binary again in namespace `ns`, running `zc_child` as `role`.
fn spawn_child(ns: &str, role: &str, vars: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut command = Command::new("ip");
    command
        .args(["netns", "exec", ns])
        .arg(exe)
        .args(["--exact", "zc_child", "--ignored", "--nocapture", "--quiet"])
        .env(ROLE, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (key, value) in vars {
        command.env(key, value);
    }
    command
        .spawn()
        .expect("the test binary runs under ip netns exec")
}

/// The value of `key=value` in a `ZC ...` line.
fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// What one exchange across the veth pair reported.
#[derive(Debug)]
struct VethRun {
    producer: String,
    consumer: String,
    elapsed: Duration,
}

/// Runs a producer in `pair.a` and a consumer in `pair.b` with `mode` and `records`; both
/// children check their records and pools and report `ZC ...` lines.
fn exchange_across(pair: &VethPair, mode: &str, records: u64) -> VethRun {
    let started = Instant::now();
    let vars = [
        (MODE, mode.to_string()),
        (RECORDS, records.to_string()),
        (
            ADDR,
            SocketAddr::from((VethPair::A, 0)).to_string(), // port 0: the child reports its port
        ),
    ];
    let mut producer = common::ChildProcess::new(spawn_child(&pair.a, "producer", &vars), LONG);
    let addr = loop {
        let line = producer.line();
        if let Some(addr) = line.strip_prefix("ZC listening ") {
            break addr.trim().to_string();
        }
    };
    let mut vars = vars.to_vec();
    vars.retain(|(k, _)| *k != ADDR);
    vars.push((ADDR, addr));
    let mut consumer = common::ChildProcess::new(spawn_child(&pair.b, "consumer", &vars), LONG);
    let consumer_status = consumer.wait();
    let consumer_text = consumer.rest().join("\n");
    // The consumer is done: the producer may stop (closing its stdin tells it).
    drop(producer.child.stdin.take());
    let producer_status = producer.wait();
    let producer_text = producer
        .rest()
        .into_iter()
        .filter(|l| l.starts_with("ZC "))
        .collect::<Vec<_>>()
        .join("\n");
    let elapsed = started.elapsed();
    assert!(
        consumer_status.success(),
        "consumer failed:\n{consumer_text}"
    );
    assert!(
        producer_status.success(),
        "producer failed:\n{producer_text}"
    );
    let consumer = consumer_text
        .lines()
        .find(|l| l.starts_with("ZC consumer"))
        .unwrap_or_else(|| panic!("a consumer report\n{consumer_text}"))
        .to_string();
    let producer = producer_text
        .lines()
        .find(|l| l.starts_with("ZC producer"))
        .unwrap_or_else(|| panic!("a producer report\n{producer_text}"))
        .to_string();
    VethRun {
        producer,
        consumer,
        elapsed,
    }
}

#[test]
fn zero_copy_sends_cross_a_veth_pair_between_namespaces() {
    let test = "zero_copy_sends_cross_a_veth_pair_between_namespaces";
    if common::skip_without_uring(test) {
        return;
    }
    let pair = match VethPair::create() {
        Ok(pair) => pair,
        Err(reason) => {
            eprintln!("SKIPPED: {test}: cannot create network namespaces here: {reason}");
            return;
        }
    };
    let records = 3_000;
    let run = exchange_across(&pair, "auto", records);
    eprintln!("{run:?}");
    assert_eq!(field(&run.consumer, "records"), Some(records));
    assert_eq!(field(&run.consumer, "pool_full"), Some(1));
    assert_eq!(field(&run.producer, "pool_full"), Some(1));
    let zc_sends = field(&run.producer, "zc_sends").unwrap();
    assert!(
        zc_sends > 0,
        "32 KiB segments to a veth peer go zero-copy: {run:?}"
    );
    assert_eq!(
        field(&run.producer, "zc_notifications"),
        Some(zc_sends),
        "every zero-copy send notified"
    );
    // Packets looped between namespaces are copied on delivery (msg_zerocopy.rst): once a
    // notification says so, the connection goes back to plain sends.
    let copied = field(&run.producer, "zc_copied").unwrap();
    let off = field(&run.producer, "zc_switched_off").unwrap();
    assert_eq!(
        off,
        u64::from(copied > 0),
        "switched off once when copied: {run:?}"
    );
    assert_eq!(
        field(&run.consumer, "zc_sends"),
        Some(0),
        "credits are small"
    );

    // Turned off by configuration: no zero-copy send at all.
    let run = exchange_across(&pair, "off", 500);
    assert_eq!(field(&run.consumer, "records"), Some(500));
    assert_eq!(field(&run.producer, "zc_sends"), Some(0), "{run:?}");
    assert_eq!(field(&run.producer, "pool_full"), Some(1));
}

/// Measures a longer exchange across the veth pair with zero-copy sends `auto`, `off` and `always`
/// (`cargo test --release --test uring_send -- --ignored --nocapture measure_veth`).
#[test]
#[ignore = "a measurement, not a check"]
fn measure_veth_zero_copy_modes() {
    if common::skip_without_uring("measure_veth") {
        return;
    }
    let pair = match VethPair::create() {
        Ok(pair) => pair,
        Err(reason) => {
            eprintln!("SKIPPED: measure_veth: cannot create network namespaces here: {reason}");
            return;
        }
    };
    let records: u64 = std::env::var("FLUXGATE_ZC_MEASURE_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40_000);
    for round in 0..3 {
        for mode in ["auto", "off", "always"] {
            let run = exchange_across(&pair, mode, records);
            println!(
                "round {round} mode {mode}: {:.3} s\n  {}\n  {}",
                run.elapsed.as_secs_f64(),
                run.producer,
                run.consumer
            );
        }
    }
}

/// One side of `zero_copy_sends_cross_a_veth_pair_between_namespaces`, run by it in a network
/// namespace; does nothing when run directly.
#[test]
#[ignore = "run by the namespace tests in a child process"]
fn zc_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let mode = std::env::var(MODE).unwrap();
    let records: u64 = std::env::var(RECORDS).unwrap().parse().unwrap();
    let addr: SocketAddr = std::env::var(ADDR).unwrap().parse().unwrap();
    let options = [("fluxgate.network.zero-copy-send", mode.as_str())];
    let cpu = || {
        // utime + stime of this process in clock ticks (/proc/self/stat fields 14, 15).
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    match role.as_str() {
        "producer" => {
            let env = env(1, addr, &options);
            println!("ZC listening {}", env.local_addr());
            std::io::stdout().flush().unwrap();
            let cpu_start = cpu();
            produce(&env, records).join().unwrap();
            // Serve until the consumer is done (the parent closes stdin).
            let mut rest = String::new();
            let _ = std::io::stdin().read_line(&mut rest);
            let full = common::pool_full(&env);
            let s = stats(&env);
            println!(
                "ZC producer pool_full={} zc_available={} zc_sends={} zc_notifications={} \
                 zc_copied={} zc_switched_off={} writes={} fixed_writes={} short_writes={} \
                 fixed_file_ops={} plain_fd_ops={} cpu_ticks={}",
                u8::from(full),
                u8::from(s.zc_available),
                s.zc_sends,
                s.zc_notifications,
                s.zc_copied,
                s.zc_switched_off,
                s.writes,
                s.fixed_writes,
                s.short_writes,
                s.fixed_file_ops,
                s.plain_fd_ops,
                cpu() - cpu_start
            );
        }
        "consumer" => {
            let env = env(2, SocketAddr::from((VethPair::B, 0)), &options);
            let cpu_start = cpu();
            let read = consume(&env, addr);
            let full = common::pool_full(&env);
            let s = stats(&env);
            println!(
                "ZC consumer records={read} pool_full={} zc_sends={} reads={} cpu_ticks={}",
                u8::from(full),
                s.zc_sends,
                s.reads,
                cpu() - cpu_start
            );
        }
        other => panic!("unknown role {other}"),
    }
}
