//! Exchanges over mutual TLS (`security.ssl.internal.*`, the epoll driver) between two
//! shuffle environments in one process, with a cluster CA and node certificates generated
//! into a temporary directory at test time. Every record is checked and both pools are full
//! at the end; peers outside the cluster (a certificate from another CA, plain TCP) are
//! refused with a typed error within a bounded time while the server keeps serving.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use fluxgate::env::EnvError;
use fluxgate::gate::{ConsumedSubpartition, GateError, ReaderError, ReaderItem, RecordReader};
use fluxgate::io::tls::{ClusterCa, PemPair, DEFAULT_SSL_SERVER_NAME};
use fluxgate::io::Transport;
use fluxgate::partition::{BufferTimeout, RecordWriter, ResultPartitionId, RoundRobinSelector};
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

/// Longest any one wait may take; a refusal must come well before it.
const LONG: Duration = Duration::from_secs(20);

/// Certificates of one test: the cluster's CA and nodes, and a stranger from another CA.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("fluxgate-tls-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cluster = ClusterCa::generate("test cluster CA").unwrap();
        let other = ClusterCa::generate("another cluster's CA").unwrap();
        let write = |name: &str, pair: &PemPair| {
            std::fs::write(dir.join(format!("{name}.pem")), &pair.cert_pem).unwrap();
            std::fs::write(dir.join(format!("{name}-key.pem")), &pair.key_pem).unwrap();
        };
        write("ca", cluster.pem());
        write("other-ca", other.pem());
        for node in ["producer", "consumer"] {
            write(
                node,
                &cluster.issue_node(node, DEFAULT_SSL_SERVER_NAME).unwrap(),
            );
        }
        write(
            "stranger",
            &other
                .issue_node("stranger", DEFAULT_SSL_SERVER_NAME)
                .unwrap(),
        );
        // Another cluster whose CA has the cluster CA's name (every `fluxgate tls-certs` CA
        // has the same one): its certificates match the trusted CA by name, and fail only
        // its signature check.
        let twin = ClusterCa::generate("test cluster CA").unwrap();
        write(
            "twin-stranger",
            &twin
                .issue_node("twin-stranger", DEFAULT_SSL_SERVER_NAME)
                .unwrap(),
        );
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_owned()
    }

    /// TLS options of a node presenting `node`'s certificate and trusting `ca`.
    fn options(&self, node: &str, ca: &str) -> Vec<(String, String)> {
        vec![
            ("security.ssl.internal.enabled".into(), "true".into()),
            (
                "security.ssl.internal.cert-file".into(),
                self.path(&format!("{node}.pem")),
            ),
            (
                "security.ssl.internal.key-file".into(),
                self.path(&format!("{node}-key.pem")),
            ),
            (
                "security.ssl.internal.ca-file".into(),
                self.path(&format!("{ca}.pem")),
            ),
        ]
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(
    node: u128,
    transport: Transport,
    options: &[(String, String)],
) -> Result<ShuffleEnvironment, EnvError> {
    let mut network = NetworkConfig::default();
    network
        .set("taskmanager.memory.segment-size", "8kb")
        .unwrap();
    network
        .set("taskmanager.memory.network.max", "16mb")
        .unwrap();
    network.set("fluxgate.memory.arena-size", "4mb").unwrap();
    for (key, value) in options {
        network.set(key, value).unwrap();
    }
    ShuffleEnvironment::start(EnvConfig {
        network,
        node,
        transport,
        ..EnvConfig::default()
    })
}

fn env(node: u128, options: &[(String, String)]) -> ShuffleEnvironment {
    let env = start(node, Transport::Epoll, options).unwrap();
    assert_eq!(env.transport(), Transport::Epoll);
    env
}

fn pid(producer: usize) -> ResultPartitionId {
    ResultPartitionId {
        partition: producer as u64,
        producer: 9,
    }
}

fn channel(
    partition: ResultPartitionId,
    subpartition: usize,
    peer: &ShuffleEnvironment,
) -> ChannelDescriptor {
    ChannelDescriptor {
        consumed: ConsumedSubpartition {
            partition,
            subpartition,
        },
        location: ProducerLocation::Remote(peer.local_addr()),
    }
}

/// P producers on `producer_env`, C consumers on `consumer_env`, round robin; every record
/// checked for content and order, and every EndOfPartition seen.
fn exchange(
    producer_env: &ShuffleEnvironment,
    consumer_env: &ShuffleEnvironment,
    producers: usize,
    consumers: usize,
    records: u64,
) {
    let partitions: Vec<_> = (0..producers)
        .map(|p| producer_env.create_partition(pid(p), consumers).unwrap())
        .collect();
    let gates: Vec<_> = (0..consumers)
        .map(|c| {
            let channels: Vec<_> = (0..producers)
                .map(|p| channel(pid(p), c, producer_env))
                .collect();
            consumer_env.create_gate(&channels).unwrap()
        })
        .collect();
    thread::scope(|s| {
        for (p, partition) in partitions.into_iter().enumerate() {
            s.spawn(move || common::write_records(partition, p, records, 5, None));
        }
        let readers: Vec<_> = gates
            .into_iter()
            .enumerate()
            .map(|(c, gate)| {
                s.spawn(move || {
                    let mut reader = RecordReader::new(gate, 1 << 20);
                    let mut next = vec![None::<u64>; producers];
                    let mut count = 0u64;
                    let mut ends = 0;
                    // Bounded: each read waits at most LONG, and the stream ends.
                    while let Some(item) = reader
                        .next_timeout(LONG)
                        .unwrap_or_else(|error| panic!("consumer {c}: {error}"))
                    {
                        match item {
                            ReaderItem::Record { channel, bytes } => {
                                let producer =
                                    u64::from_be_bytes(bytes[..8].try_into().unwrap()) as usize;
                                let seq = u64::from_be_bytes(bytes[8..16].try_into().unwrap());
                                assert_eq!(producer, channel);
                                assert_eq!(
                                    bytes,
                                    &common::record(producer, seq)[..],
                                    "payload intact"
                                );
                                assert_eq!(seq as usize % consumers, c, "round robin");
                                let expected =
                                    next[producer].map_or(c as u64, |s| s + consumers as u64);
                                assert_eq!(seq, expected, "in order, none lost");
                                next[producer] = Some(seq);
                                count += 1;
                            }
                            ReaderItem::Event { .. } => ends += 1,
                        }
                    }
                    assert_eq!(ends, producers, "one EndOfPartition per producer");
                    count
                })
            })
            .collect();
        let total: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert_eq!(total, records * producers as u64);
    });
}

/// [`exchange`] between two TLS nodes of one CA, each with the TLS options plus `extra`;
/// both pools full at the end.
fn exchange_over_tls(
    name: &str,
    producers: usize,
    consumers: usize,
    records: u64,
    extra: &[(&str, &str)],
) {
    let certs = Certs::new(name);
    let options = |node: &str| {
        let mut options = certs.options(node, "ca");
        options.extend(extra.iter().map(|&(k, v)| (k.to_string(), v.to_string())));
        options
    };
    let producer = env(1, &options("producer"));
    let consumer = env(2, &options("consumer"));
    exchange(&producer, &consumer, producers, consumers, records);
    assert!(
        common::pools_full(&[&producer, &consumer]),
        "segments leaked"
    );
}

#[test]
fn one_to_one_over_tls() {
    exchange_over_tls("one", 1, 1, 20_000, &[]);
}

#[test]
fn four_to_four_over_tls() {
    exchange_over_tls("four", 4, 4, 5_000, &[]);
}

#[test]
fn four_to_four_over_tls_with_busy_polling_io_threads() {
    exchange_over_tls(
        "busy",
        4,
        4,
        5_000,
        &[("fluxgate.network.io-thread.busy-poll-us", "200")],
    );
}

#[test]
fn tls_runs_on_epoll_auto_picks_it_and_uring_is_refused() {
    let certs = Certs::new("transport");
    let options = certs.options("producer", "ca");
    let auto = start(1, Transport::Auto, &options).unwrap();
    assert_eq!(
        auto.transport(),
        Transport::Epoll,
        "auto picks epoll with TLS"
    );
    match start(2, Transport::Uring, &options) {
        Err(EnvError::Transport(Transport::Uring, reason)) => {
            assert!(reason.contains("TLS"), "{reason}")
        }
        other => panic!("uring with TLS must be refused, got {other:?}"),
    }
    // A missing file is a startup error naming the option, not a failure per connection.
    let mut incomplete = options.clone();
    incomplete.retain(|(key, _)| key != "security.ssl.internal.ca-file");
    let error = start(3, Transport::Epoll, &incomplete).unwrap_err();
    assert!(
        error.to_string().contains("security.ssl.internal.ca-file"),
        "{error}"
    );
}

/// The first record of a one-channel gate on `consumer` reading `partition`'s only
/// subpartition from `producer` (`None` for an event or the end), and how long it took.
fn first_record(
    producer: &ShuffleEnvironment,
    consumer: &ShuffleEnvironment,
    partition: ResultPartitionId,
) -> (Result<Option<Vec<u8>>, ReaderError>, Duration) {
    first_record_from(producer.local_addr(), consumer, partition)
}

/// [`first_record`] from whatever listens at `producer`.
fn first_record_from(
    producer: SocketAddr,
    consumer: &ShuffleEnvironment,
    partition: ResultPartitionId,
) -> (Result<Option<Vec<u8>>, ReaderError>, Duration) {
    let gate = consumer
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition,
                subpartition: 0,
            },
            location: ProducerLocation::Remote(producer),
        }])
        .unwrap();
    let mut reader = RecordReader::new(gate, 1 << 20);
    let started = Instant::now();
    let first = reader.next_timeout(LONG).map(|item| match item {
        Some(ReaderItem::Record { bytes, .. }) => Some(bytes.to_vec()),
        _ => None,
    });
    (first, started.elapsed())
}

/// A partition of one subpartition holding one record, flushed.
fn holding_one_record(
    env: &ShuffleEnvironment,
    id: ResultPartitionId,
) -> fluxgate::partition::ResultPartition {
    let mut partition = env.create_partition(id, 1).unwrap();
    partition.emit_record(&common::record(0, 0)[..], 0).unwrap();
    partition.flush_all();
    partition
}

/// Releases `partition` (never fully consumed) so its segments go back.
fn release(
    env: &ShuffleEnvironment,
    partition: fluxgate::partition::ResultPartition,
    id: ResultPartitionId,
) {
    drop(partition);
    env.partition_manager().release(id).unwrap();
}

#[test]
fn certificates_from_another_ca_are_refused_and_the_server_serves_others() {
    let certs = Certs::new("stranger");
    let producer = env(1, &certs.options("producer", "ca"));
    let partition = holding_one_record(&producer, pid(0));
    // The producer refuses a stranger that trusts the cluster CA but presents a certificate
    // of another; a stranger of another cluster altogether refuses the producer itself.
    let strangers = [
        ("stranger certificate", certs.options("stranger", "ca")),
        ("stranger CA", certs.options("stranger", "other-ca")),
        (
            "certificate of a CA named as the cluster's",
            certs.options("twin-stranger", "ca"),
        ),
    ];
    for (node, (name, options)) in strangers.iter().enumerate() {
        let stranger = env(10 + node as u128, options);
        let (first, took) = first_record(&producer, &stranger, pid(0));
        assert!(
            matches!(
                first,
                Err(ReaderError::Gate(GateError::Unauthenticated {
                    channel: 0,
                    ..
                }))
            ),
            "{name}: got {first:?} after {took:?}"
        );
        assert!(
            common::pools_full(&[&stranger]),
            "{name}: stranger segments leaked"
        );
    }
    // The producer still serves the cluster: the record it holds, then a full exchange.
    let consumer = env(2, &certs.options("consumer", "ca"));
    let (first, _) = first_record(&producer, &consumer, pid(0));
    assert_eq!(
        first,
        Ok(Some(common::record(0, 0))),
        "the cluster's consumer"
    );
    release(&producer, partition, pid(0));
    exchange(&producer, &consumer, 1, 1, 2_000);
    assert!(
        common::pools_full(&[&producer, &consumer]),
        "segments leaked"
    );
}

#[test]
fn plain_tcp_peers_and_tls_nodes_do_not_mix() {
    let certs = Certs::new("plain");
    let producer = env(1, &certs.options("producer", "ca"));
    let partition = holding_one_record(&producer, pid(0));
    // A plain-TCP consumer: its handshake frame is no TLS record; the producer closes.
    let plain = env(2, &[]);
    let (first, took) = first_record(&producer, &plain, pid(0));
    assert!(
        matches!(
            first,
            Err(ReaderError::Gate(GateError::ConnectionLost { channel: 0, peer, .. }))
                if peer == producer.local_addr()
        ),
        "plain consumer: got {first:?} after {took:?}"
    );
    // A raw peer sending bytes that are no TLS record is closed: EOF (or a reset) within the
    // read timeout, after at most an alert.
    let mut raw = TcpStream::connect(producer.local_addr()).unwrap();
    raw.set_read_timeout(Some(LONG)).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    match raw.read_to_end(&mut answer) {
        Ok(_) => assert!(answer.len() < 64, "at most an alert: {answer:?}"),
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{error}"),
    }
    // A TLS consumer of a plain producer fails too.
    let plain_producer = env(3, &[]);
    let plain_partition = holding_one_record(&plain_producer, pid(1));
    let consumer = env(4, &certs.options("consumer", "ca"));
    let (first, took) = first_record(&plain_producer, &consumer, pid(1));
    assert!(
        matches!(
            first,
            Err(ReaderError::Gate(GateError::ConnectionLost { channel: 0, peer, .. }))
                if peer == plain_producer.local_addr()
        ),
        "TLS consumer of a plain producer: got {first:?} after {took:?}"
    );
    release(&plain_producer, plain_partition, pid(1));
    // The TLS producer still serves its cluster.
    let (first, _) = first_record(&producer, &consumer, pid(0));
    assert_eq!(
        first,
        Ok(Some(common::record(0, 0))),
        "the cluster's consumer"
    );
    release(&producer, partition, pid(0));
    assert!(common::pools_full(&[
        &producer,
        &plain,
        &plain_producer,
        &consumer
    ]));
}

#[test]
fn a_slow_tls_consumer_keeps_the_producer_within_its_pool() {
    let certs = Certs::new("slow");
    let producer_env = env(1, &certs.options("producer", "ca"));
    let consumer_env = env(2, &certs.options("consumer", "ca"));
    let partition = producer_env.create_partition(pid(0), 1).unwrap();
    let max = partition.pool().spec().max_segments;
    let gate = consumer_env
        .create_gate(&[channel(pid(0), 0, &producer_env)])
        .unwrap();
    let records = 3_000u64;
    // The consumer starts reading only once the producer filled its whole pool: from then on
    // the producer can only go on as the consumer frees segments (back pressure, shown by the
    // pool's blocked time), never past its pool.
    let peak = std::sync::atomic::AtomicUsize::new(0);
    thread::scope(|s| {
        let producer = s.spawn(|| {
            let mut writer = RecordWriter::new(
                partition,
                RoundRobinSelector::default(),
                BufferTimeout::Never,
            );
            for seq in 0..records {
                writer.emit(&common::record(0, seq)[..]).unwrap();
                let in_use = writer.partition().pool().in_use_segments();
                peak.fetch_max(in_use, std::sync::atomic::Ordering::Relaxed);
            }
            writer.finish().unwrap();
            writer.partition().pool().blocked_nanos()
        });
        assert!(
            common::wait_until(LONG, || {
                peak.load(std::sync::atomic::Ordering::Relaxed) == max
            }),
            "the producer never filled its pool"
        );
        let mut reader = RecordReader::new(gate, 1 << 20);
        let mut count = 0;
        // Bounded: each read waits at most LONG, and the stream ends.
        loop {
            match reader.next_timeout(LONG).unwrap() {
                Some(ReaderItem::Record { bytes, .. }) => {
                    assert_eq!(bytes, &common::record(0, count)[..]);
                    count += 1;
                }
                Some(ReaderItem::Event { .. }) => {}
                None => break,
            }
            assert!(reader.gate().pool_usage() <= 1.0);
        }
        assert_eq!(count, records);
        let blocked = producer.join().unwrap();
        assert!(blocked > 0, "the producer was never held back");
        let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
        assert!(peak <= max, "producer used {peak} segments, pool max {max}");
    });
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}

#[test]
fn stalled_tls_handshakes_are_closed_after_the_timeout() {
    let certs = Certs::new("stall");
    let with_timeout = |node: &str| {
        let mut options = certs.options(node, "ca");
        options.push((
            "security.ssl.internal.handshake-timeout".into(),
            "200".into(),
        ));
        options
    };
    // Far above the configured 200 ms and below the 10 s default: only the configured
    // timeout ends these waits in time (this test is about a time, so its bound is one).
    const WITHIN: Duration = Duration::from_secs(8);
    let producer = env(1, &with_timeout("producer"));
    // A peer that connects and never says a word is closed by the producer; our read gives
    // up (an error other than a reset) if the close does not come within WITHIN.
    let mut silent = TcpStream::connect(producer.local_addr()).unwrap();
    silent.set_read_timeout(Some(WITHIN)).unwrap();
    let mut answer = Vec::new();
    match silent.read_to_end(&mut answer) {
        Ok(_) => assert!(answer.is_empty(), "nothing but the close: {answer:?}"),
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{error}"),
    }
    // A consumer whose producer accepts the connection (the kernel's backlog does) and never
    // answers its hello fails with a transport error.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let consumer = env(2, &with_timeout("consumer"));
    let (first, took) = first_record_from(mute.local_addr().unwrap(), &consumer, pid(0));
    assert!(
        matches!(
            first,
            Err(ReaderError::Gate(GateError::ConnectionLost { channel: 0, ref reason, .. }))
                if reason.contains("handshake timed out")
        ),
        "mute producer: got {first:?} after {took:?}"
    );
    assert!(took < WITHIN, "failed only after {took:?}");
    drop(mute);
    assert!(common::pools_full(&[&producer, &consumer]));
}

/// A channel with something to send (a task event) on a connection whose TLS handshake has
/// not ended is no work for the I/O thread until the handshake moves on: the thread sleeps
/// meanwhile instead of polling without a wait until the handshake times out.
#[test]
fn an_i_o_thread_sleeps_through_a_stalled_tls_handshake_with_a_task_event_waiting() {
    let certs = Certs::new("stall-event");
    let mut options = certs.options("consumer", "ca");
    options.push((
        "security.ssl.internal.handshake-timeout".into(),
        "1000".into(),
    ));
    let consumer = env(2, &options);
    // The kernel's backlog accepts the connection; nothing ever answers the hello.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut gate = consumer
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: pid(0),
                subpartition: 0,
            },
            location: ProducerLocation::Remote(mute.local_addr().unwrap()),
        }])
        .unwrap();
    gate.send_task_event(&fluxgate::event::Event::Task(b"waiting".to_vec()))
        .unwrap();
    let turns = || {
        consumer
            .driver_stats_within(LONG)
            .expect("the I/O thread answers")
            .turns
    };
    let before = turns();
    let mut reader = RecordReader::new(gate, 1 << 20);
    let first = reader.next_timeout(LONG);
    assert!(
        matches!(
            first,
            Err(ReaderError::Gate(GateError::ConnectionLost { ref reason, .. }))
                if reason.contains("handshake timed out")
        ),
        "mute producer: got {first:?}"
    );
    // A sleeping thread turns about once per 100 ms (its longest park) in the second the
    // handshake waits; one polling without a wait turns hundreds of thousands of times.
    let turned = turns() - before;
    assert!(turned < 5_000, "the I/O thread turned {turned} times");
    drop(reader);
    drop(mute);
    assert!(common::pools_full(&[&consumer]));
}

/// A raw TLS consumer (certified by the test CA as "consumer") connected to `producer`, its
/// TLS handshake not begun.
fn raw_tls_consumer(
    certs: &Certs,
    producer: &ShuffleEnvironment,
) -> (rustls::ClientConnection, TcpStream) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(certs.path("ca.pem")).unwrap() {
        roots.add(ca.unwrap()).unwrap();
    }
    let chain: Vec<_> = CertificateDer::pem_file_iter(certs.path("consumer.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(certs.path("consumer-key.pem")).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .unwrap();
    let name = ServerName::try_from(DEFAULT_SSL_SERVER_NAME).unwrap();
    let session = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let socket = TcpStream::connect(producer.local_addr()).unwrap();
    socket.set_read_timeout(Some(LONG)).unwrap();
    (session, socket)
}

/// Runs `session`'s TLS handshake over `socket` to its end.
fn complete_tls_handshake(
    session: &mut rustls::ClientConnection,
    socket: &mut TcpStream,
) -> std::io::Result<()> {
    // Bounded: each round trip moves the handshake on, or fails.
    for _ in 0..100 {
        if !session.is_handshaking() {
            return Ok(());
        }
        session.complete_io(socket)?;
    }
    Err(std::io::Error::other("the TLS handshake did not end"))
}

/// The protocol's handshake timeout counts from when TLS is up, not from the accept: a TLS
/// handshake has `security.ssl.internal.handshake-timeout` for itself. The protocol's
/// deadline ran from the first loop turn, so the smaller of the two timeouts cut it off.
#[test]
fn a_tls_handshake_has_its_own_timeout_not_the_protocol_s() {
    let certs = Certs::new("tls-budget");
    let mut options = certs.options("producer", "ca");
    options.push(("fluxgate.network.handshake-timeout".into(), "2000".into()));
    let producer = env(1, &options);
    let (mut session, mut socket) = raw_tls_consumer(&certs, &producer);
    // A peer slow to start its TLS handshake, well past the protocol's 2 s (and its driver's
    // turns) and within the TLS handshake's default 10 s: the scenario, not a wait for
    // something. (The protocol's handshake below has its whole two seconds.)
    std::thread::sleep(Duration::from_millis(3000));
    complete_tls_handshake(&mut session, &mut socket)
        .expect("the producer waits out the TLS handshake's own timeout");
    // Now the protocol's handshake, at once; then an orderly close, and what the producer
    // said until it closed too: its handshake, and no error.
    session.writer().write_all(&consumer_hello()).unwrap();
    session.send_close_notify();
    while session.wants_write() {
        session.write_tls(&mut socket).unwrap();
    }
    let said = frames_until_closed(&mut session, &mut socket);
    assert_eq!(
        said,
        [fluxgate::protocol::frame::MessageId::Handshake],
        "the protocol's handshake timed out during the TLS handshake"
    );
    assert!(common::wait_until(LONG, || producer
        .driver_stats()
        .is_some_and(|stats| stats.open_connections == 0)));
    drop((session, socket));
    assert!(common::pools_full(&[&producer]));
}

/// The kinds of the frames the producer sends over `session` until it closes the connection.
fn frames_until_closed(
    session: &mut rustls::ClientConnection,
    socket: &mut TcpStream,
) -> Vec<fluxgate::protocol::frame::MessageId> {
    use fluxgate::protocol::frame::{decode_header, FRAME_HEADER};
    let mut plain = Vec::new();
    // Bounded: each read waits at most LONG, and what the producer sends is finite.
    for _ in 0..1000 {
        match session.read_tls(socket) {
            Ok(0) => break,
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(error) => panic!("the producer kept the connection open: {error}"),
        }
        if session.process_new_packets().is_err() {
            break;
        }
        match session.reader().read_to_end(&mut plain) {
            Ok(_) => break, // its close_notify
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
    }
    let mut kinds = Vec::new();
    let mut rest = &plain[..];
    while rest.len() >= FRAME_HEADER {
        let header = decode_header(rest[..FRAME_HEADER].try_into().unwrap(), usize::MAX)
            .expect("a frame header");
        kinds.push(header.id);
        rest = &rest[(header.length as usize).min(rest.len())..];
    }
    kinds
}

/// A consumer's protocol handshake frame (node 666, no authentication).
fn consumer_hello() -> Vec<u8> {
    let mut hello = Vec::new();
    fluxgate::protocol::Message::Handshake {
        version: fluxgate::protocol::frame::VERSION,
        node: 666,
        authenticate: false,
        nonce: [0; 32],
    }
    .encode(&mut hello);
    hello
}

#[test]
fn a_peer_s_close_notify_ends_the_connection_though_its_socket_stays_open() {
    let certs = Certs::new("close-notify");
    let producer = env(1, &certs.options("producer", "ca"));
    let (mut session, mut socket) = raw_tls_consumer(&certs, &producer);
    complete_tls_handshake(&mut session, &mut socket).unwrap();
    assert!(!session.is_handshaking(), "the TLS handshake completed");
    // The protocol's handshake too, so that no handshake deadline closes the connection.
    session.writer().write_all(&consumer_hello()).unwrap();
    session.send_close_notify();
    while session.wants_write() {
        session.write_tls(&mut socket).unwrap();
    }
    // The TCP connection stays open on this side: only the producer can end it now.
    let mut scratch = [0u8; 4096];
    let mut closed = false;
    // Bounded: what the producer still sends is finite, and each read waits at most LONG.
    for _ in 0..1000 {
        match socket.read(&mut scratch) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {
                closed = true;
                break;
            }
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => panic!("the producer kept the connection open: {error}"),
        }
    }
    assert!(closed, "the producer closed the connection");
    assert!(common::wait_until(LONG, || producer
        .driver_stats()
        .is_some_and(|stats| stats.open_connections == 0)));
    assert!(common::pools_full(&[&producer]));
}
