//! `fluxgate stress --netns`: the nodes of a stress run, each in its own network namespace,
//! joined over veth pairs by a bridge, with impaired links.
//!
//! Layout (a star around a bridge that lives in a namespace of its own, so nothing is added
//! to the host's network and two runs never see each other's addresses or devices):
//!
//! ```text
//!   PREFIX-node0            PREFIX-hub                 PREFIX-node1
//!   fg0 10.A.B.1/24 ──veth── n0 ┐                  ┌ n1 ──veth── fg0 10.A.B.2/24
//!                               └──── br0 (bridge) ┘   ...
//! ```
//!
//! `PREFIX` is `fluxgate-PID-RAND-` (the pid of the run and 16 random bits), so parallel runs
//! never collide and a leftover names the run that left it. Impairments go on each node's
//! `fg0`: netem on its egress (delay, jitter, loss and rate in one qdisc) where the kernel has
//! it; otherwise tbf for the rate, and for the loss a tc filter on its ingress: gact's random
//! drop, or where gact is missing too, a u32 match on the low bits of the IPv4 identification
//! that redirects the packet (mirred) into a veth whose far end discards it. Every namespace
//! made is deleted when the [`Lab`] drops, on success, error, interruption or panic; the
//! devices in them go with them.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Longest one `ip` or `tc` command may take; it is killed past that.
const COMMAND_LIMIT: Duration = Duration::from_secs(10);

/// The node's device in its namespace.
const NODE_DEVICE: &str = "fg0";
/// The device that swallows what the u32 loss filter redirects, and its far end.
const DROP_DEVICE: &str = "fgdrop";
const DROP_PEER: &str = "fgdrop-sink";
/// The bridge in the hub namespace.
const BRIDGE: &str = "br0";

/// Set by SIGINT, SIGTERM or SIGHUP once [`catch_interrupts`] ran: the run stops, kills its
/// nodes and tears the namespaces down instead of dying with them in place.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Turns SIGINT and SIGTERM, and SIGHUP when `hangup`, into [`INTERRUPTED`] (the default
/// action would end the process before its nodes are stopped and its directory, or its
/// namespaces, removed). SIGHUP only where leaving namespaces behind is worse than ending a
/// run started with `nohup`: a caught signal is no longer ignored.
pub fn catch_interrupts(hangup: bool) -> Result<(), String> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let hangup = hangup.then_some(SIGHUP);
    for signal in [SIGINT, SIGTERM].into_iter().chain(hangup) {
        signal_hook::flag::register(signal, &INTERRUPTED)
            .map_err(|e| format!("cannot catch signal {signal}: {e}"))?;
    }
    Ok(())
}

fn interrupted() -> Result<(), String> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        Err("interrupted".into())
    } else {
        Ok(())
    }
}

/// What the links should do to the packets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Impairments {
    /// One-way delay each node's link adds to what it sends, ms.
    pub delay_ms: f64,
    /// Random variation of that delay, ± ms.
    pub jitter_ms: f64,
    /// Packets lost on the way into each node, percent.
    pub loss_pct: f64,
    /// Most each node sends, Mbit/s.
    pub rate_mbit: Option<f64>,
}

impl Impairments {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), String> {
        let finite_non_negative = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("--{name} {v}: must be a number of at least 0"))
            }
        };
        finite_non_negative("delay", self.delay_ms)?;
        finite_non_negative("jitter", self.jitter_ms)?;
        finite_non_negative("loss", self.loss_pct)?;
        if self.loss_pct >= 100.0 {
            return Err(format!(
                "--loss {}: must be below 100 (percent)",
                self.loss_pct
            ));
        }
        if let Some(rate) = self.rate_mbit {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(format!("--rate-limit {rate}: must be above 0 (Mbit/s)"));
            }
        }
        Ok(())
    }

    fn wants_netem(&self) -> bool {
        self.delay_ms > 0.0 || self.jitter_ms > 0.0 || self.loss_pct > 0.0
    }
}

/// What effective uid this process has, from `/proc/self/status` (`Uid: real effective ...`).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// The first executable `name` on `PATH`.
fn find_program(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The tools `--netns` needs, found before anything is changed.
#[derive(Clone, Debug)]
pub struct Tools {
    /// `ip` (iproute2).
    pub ip: PathBuf,
    /// `tc` (iproute2), needed only for impairments.
    pub tc: Option<PathBuf>,
}

/// Checks that this process may make namespaces and finds `ip` and `tc`: one clear error
/// when it cannot go on.
pub fn preflight() -> Result<Tools, String> {
    match effective_uid() {
        Some(0) => {}
        Some(uid) => {
            return Err(format!(
                "--netns needs root: creating network namespaces and veth pairs takes \
                 CAP_SYS_ADMIN and CAP_NET_ADMIN, and this process runs as uid {uid} \
                 (try sudo, or run stress without --netns)"
            ))
        }
        None => {
            return Err(
                "--netns needs root, and /proc/self/status does not say who this process is".into(),
            )
        }
    }
    let ip = find_program("ip").ok_or(
        "--netns needs the `ip` command (iproute2), and none is on PATH \
         (install iproute2, e.g. `apt-get install iproute2`)",
    )?;
    Ok(Tools {
        ip,
        tc: find_program("tc"),
    })
}

/// Runs `program args` within [`COMMAND_LIMIT`]; its stdout, or an error naming the command
/// and the first line of its stderr. The command runs in a process group of its own: a
/// terminal's Ctrl-C sends SIGINT to the whole foreground group, and the `ip netns del` of a
/// teardown that signal started must not die with it (leaving its namespace behind).
fn run(program: &Path, args: &[&str]) -> Result<String, String> {
    use std::os::unix::process::CommandExt as _;
    let shown = || {
        let name = program.file_name().map_or_else(
            || program.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        format!("{name} {}", args.join(" "))
    };
    let mut child = Command::new(program)
        .args(args)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run `{}`: {e}", shown()))?;
    // Drained while it runs: a command that writes more than a pipe holds must not block.
    fn drain(pipe: Option<impl std::io::Read + Send + 'static>) -> thread::JoinHandle<Vec<u8>> {
        thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut out);
            }
            out
        })
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + COMMAND_LIMIT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(2)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "`{}` still ran after {} s; killed",
                    shown(),
                    COMMAND_LIMIT.as_secs()
                ));
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("waiting for `{}` failed: {e}", shown()));
            }
        }
    };
    // It has exited: the pipes end, and their threads with them.
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if status.success() {
        return Ok(String::from_utf8_lossy(&stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&stderr);
    let why = stderr
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map_or_else(|| status.to_string(), str::to_string);
    Err(format!("`{}` failed: {why}", shown()))
}

/// The /24 the nodes' addresses come from: `A.B.C.0/24` (or `A.B.C`).
pub fn parse_subnet(text: &str) -> Result<[u8; 3], String> {
    let bad = || format!("--netns-subnet `{text}`: expected an IPv4 /24 such as 10.77.3.0/24");
    let address = match text.split_once('/') {
        Some((address, "24")) => address,
        Some(_) => return Err(bad()),
        None => text,
    };
    let parts: Vec<&str> = address.split('.').collect();
    let octets: Vec<u8> = match parts.len() {
        3 | 4 => parts
            .iter()
            .map(|p| p.parse::<u8>().map_err(|_| bad()))
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    if octets.len() == 4 && octets[3] != 0 {
        return Err(bad());
    }
    Ok([octets[0], octets[1], octets[2]])
}

/// A /24 in 10.0.0.0/8 named by `pid`, so logs of parallel runs tell them apart (the
/// namespaces are isolated anyway: two runs with one subnet do not meet).
pub fn subnet_for(pid: u32) -> [u8; 3] {
    [10, (pid >> 8) as u8, pid as u8]
}

/// One node's namespace.
#[derive(Clone, Debug)]
pub struct NodeNamespace {
    /// The namespace (`ip netns exec NAME ...`).
    pub name: String,
    /// The node's address there.
    pub addr: Ipv4Addr,
}

/// How the loss is made, where netem is missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LossFilter {
    /// gact's random drop: 1 packet in `one_in`.
    Gact { one_in: u32 },
    /// Drop packets whose IPv4 identification is 1 modulo 2^bits: every 2^bits-th packet of
    /// a flow (Linux numbers a connection's packets consecutively). Not 0 modulo: Linux
    /// sends some packets, SYN-ACKs among them, with identification 0 every time, so that
    /// residue would drop every retry of a handshake.
    IdBits { bits: u32 },
}

impl LossFilter {
    fn percent(self) -> f64 {
        match self {
            LossFilter::Gact { one_in } => 100.0 / f64::from(one_in),
            LossFilter::IdBits { bits } => 100.0 / f64::from(1u32 << bits),
        }
    }

    fn describe(self) -> String {
        match self {
            LossFilter::Gact { one_in } => format!(
                "loss {:.3}% arriving (tc gact random drop, 1 in {one_in})",
                self.percent()
            ),
            LossFilter::IdBits { bits } => format!(
                "loss {:.3}% arriving (1 in {} packets of each flow: tc u32 on the IPv4 id + \
                 mirred into a discarding veth; no gact)",
                self.percent(),
                1u32 << bits
            ),
        }
    }
}

/// What was applied to every node's link, and what could not be.
#[derive(Debug, Default)]
pub struct Applied {
    /// One phrase per impairment in force.
    pub applied: Vec<String>,
    /// The loud line for stderr when something asked for is missing.
    pub missing: Option<String>,
}

/// The namespaces of one run; deleting them all when dropped.
#[derive(Debug)]
pub struct Lab {
    tools: Tools,
    prefix: String,
    /// Every namespace this run created, in order (only these are deleted).
    created: Vec<String>,
    /// The loss filter on every node's ingress, if one was needed.
    loss_filter: Option<LossFilter>,
    /// Per node.
    pub nodes: Vec<NodeNamespace>,
}

impl Lab {
    /// Creates the hub with its bridge and one namespace per node, linked and addressed.
    pub fn build(tools: Tools, nodes: usize, subnet: [u8; 3]) -> Result<Self, String> {
        if nodes == 0 || nodes > 253 {
            return Err(format!(
                "--netns gives each node an address of one /24: 1 to 253 nodes, not {nodes}"
            ));
        }
        let mut salt = [0u8; 2];
        getrandom::fill(&mut salt).map_err(|e| format!("no randomness for the names: {e}"))?;
        let prefix = format!(
            "fluxgate-{}-{:04x}-",
            std::process::id(),
            u16::from_le_bytes(salt)
        );
        let hub = format!("{prefix}hub");
        let mut lab = Lab {
            tools,
            created: Vec::new(),
            loss_filter: None,
            nodes: (0..nodes)
                .map(|i| NodeNamespace {
                    name: format!("{prefix}node{i}"),
                    addr: Ipv4Addr::new(subnet[0], subnet[1], subnet[2], i as u8 + 1),
                })
                .collect(),
            prefix,
        };
        // An error from here on drops `lab`, which deletes what was made so far.
        lab.add_namespace(&hub)?;
        lab.ip(&["-n", &hub, "link", "add", BRIDGE, "type", "bridge"])?;
        lab.ip(&["-n", &hub, "link", "set", BRIDGE, "up"])?;
        for i in 0..nodes {
            let name = lab.nodes[i].name.clone();
            let addr = format!("{}/24", lab.nodes[i].addr);
            let port = format!("n{i}");
            lab.add_namespace(&name)?;
            // Both ends are made from the hub, the node's end straight in its namespace: no
            // device ever appears in the host's namespace.
            lab.ip(&[
                "-n",
                &hub,
                "link",
                "add",
                &port,
                "type",
                "veth",
                "peer",
                "name",
                NODE_DEVICE,
                "netns",
                &name,
            ])?;
            lab.ip(&["-n", &hub, "link", "set", &port, "master", BRIDGE, "up"])?;
            lab.ip(&["-n", &name, "addr", "add", &addr, "dev", NODE_DEVICE])?;
            lab.ip(&["-n", &name, "link", "set", NODE_DEVICE, "up"])?;
            // A node's connections to its own address go over lo.
            lab.ip(&["-n", &name, "link", "set", "lo", "up"])?;
        }
        Ok(lab)
    }

    /// The namespaces' common prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `ip`, to run nodes with `ip netns exec`.
    pub fn ip_program(&self) -> &Path {
        &self.tools.ip
    }

    fn add_namespace(&mut self, name: &str) -> Result<(), String> {
        interrupted()?;
        run(&self.tools.ip, &["netns", "add", name])?;
        self.created.push(name.to_string());
        Ok(())
    }

    fn ip(&self, args: &[&str]) -> Result<String, String> {
        interrupted()?;
        run(&self.tools.ip, args)
    }

    fn tc(&self, tc: &Path, netns: &str, args: &[&str]) -> Result<String, String> {
        interrupted()?;
        let mut all = vec!["-n", netns];
        all.extend_from_slice(args);
        run(tc, &all)
    }

    /// Puts `impairments` on every node's link: each mechanism is tried on node 0 first,
    /// and what works there is applied to the others (where a failure is an error).
    pub fn impair(&mut self, impairments: &Impairments) -> Result<Applied, String> {
        let mut result = Applied::default();
        let wanted = impairments.wants_netem() || impairments.rate_mbit.is_some();
        if !wanted {
            return Ok(result);
        }
        let Some(tc) = self.tools.tc.clone() else {
            result.missing = Some(
                "NOT APPLIED: no link impairments, the `tc` command (iproute2) is not on PATH"
                    .into(),
            );
            return Ok(result);
        };
        let first = self.nodes[0].name.clone();
        let mut missing: Vec<String> = Vec::new();
        let mut netem_missing = None;
        if impairments.wants_netem() {
            let netem = netem_args(impairments);
            match self.tc(&tc, &first, &to_refs(&netem)) {
                Ok(_) => {
                    for node in &self.nodes[1..] {
                        self.tc(&tc, &node.name, &to_refs(&netem))?;
                    }
                    result.applied.push(describe_netem(impairments));
                    return Ok(result);
                }
                Err(error) => {
                    interrupted()?;
                    netem_missing = Some(error);
                }
            }
        }
        if let Some(error) = &netem_missing {
            let mut lost = Vec::new();
            if impairments.delay_ms > 0.0 {
                lost.push(format!("delay {} ms", impairments.delay_ms));
            }
            if impairments.jitter_ms > 0.0 {
                lost.push(format!("jitter {} ms", impairments.jitter_ms));
            }
            // The tc message alone: the command is the one README names.
            let why = error
                .split_once("` failed: ")
                .map_or(error.as_str(), |(_, why)| why);
            missing.push(format!(
                "tc qdisc netem is missing in this kernel ({why}){}",
                if lost.is_empty() {
                    String::new()
                } else {
                    format!(": {} NOT APPLIED (no fallback)", lost.join(" and "))
                }
            ));
        }
        if let Some(rate) = impairments.rate_mbit {
            let tbf = tbf_args(rate);
            match self.tc(&tc, &first, &to_refs(&tbf)) {
                Ok(_) => {
                    for node in &self.nodes[1..] {
                        self.tc(&tc, &node.name, &to_refs(&tbf))?;
                    }
                    result.applied.push(format!(
                        "rate {rate} Mbit/s sent per node (tc tbf{})",
                        if netem_missing.is_some() {
                            ", as netem is missing"
                        } else {
                            ""
                        }
                    ));
                }
                Err(error) => {
                    interrupted()?;
                    missing.push(format!("--rate-limit {rate} NOT APPLIED: {error}"));
                }
            }
        }
        if impairments.loss_pct > 0.0 {
            match self.loss_filter(&tc, &first, impairments.loss_pct) {
                Ok(filter) => {
                    self.loss_filter = Some(filter);
                    for node in &self.nodes[1..] {
                        self.apply_loss_filter(&tc, &node.name, filter)?;
                    }
                    result.applied.push(filter.describe());
                    missing.push(format!(
                        "loss {}% falls back to {}",
                        impairments.loss_pct,
                        match filter {
                            LossFilter::Gact { .. } => "tc gact's random drop".to_string(),
                            LossFilter::IdBits { bits } => format!(
                                "dropping 1 in {} packets of each flow (tc u32 + mirred; the gact action is missing too)",
                                1u32 << bits
                            ),
                        }
                    ));
                }
                Err(error) => {
                    interrupted()?;
                    missing.push(format!(
                        "--loss {}% NOT APPLIED: {error}",
                        impairments.loss_pct
                    ));
                }
            }
        }
        if !missing.is_empty() {
            result.missing = Some(missing.join("; "));
        }
        Ok(result)
    }

    /// Finds a loss filter that works on `netns` (gact first) and leaves it applied there.
    fn loss_filter(&self, tc: &Path, netns: &str, loss_pct: f64) -> Result<LossFilter, String> {
        self.tc(tc, netns, &["qdisc", "add", "dev", NODE_DEVICE, "clsact"])
            .map_err(|e| format!("no clsact qdisc for a filter: {e}"))?;
        let one_in = (100.0 / loss_pct).round().clamp(1.0, 10000.0) as u32;
        let gact = LossFilter::Gact { one_in };
        let gact_error = match self.tc(tc, netns, &to_refs(&loss_filter_args(gact))) {
            Ok(_) => return Ok(gact),
            Err(error) => error,
        };
        interrupted()?;
        // 2^bits nearest to 100 / loss on a log scale: 1% -> 1 in 128, 2% -> 1 in 64.
        let bits = (100.0 / loss_pct).log2().round().clamp(1.0, 14.0) as u32;
        let id_bits = LossFilter::IdBits { bits };
        self.apply_loss_filter_devices(netns)
            .and_then(|()| self.tc(tc, netns, &to_refs(&loss_filter_args(id_bits))))
            .map_err(|e| format!("neither gact ({gact_error}) nor u32 + mirred ({e}) works"))?;
        Ok(id_bits)
    }

    fn apply_loss_filter(&self, tc: &Path, netns: &str, filter: LossFilter) -> Result<(), String> {
        self.tc(tc, netns, &["qdisc", "add", "dev", NODE_DEVICE, "clsact"])?;
        if let LossFilter::IdBits { .. } = filter {
            self.apply_loss_filter_devices(netns)?;
        }
        self.tc(tc, netns, &to_refs(&loss_filter_args(filter)))?;
        Ok(())
    }

    /// The veth pair that swallows redirected packets: the far end has no address, so the
    /// packets arriving there are for no one and are discarded.
    fn apply_loss_filter_devices(&self, netns: &str) -> Result<(), String> {
        self.ip(&[
            "-n",
            netns,
            "link",
            "add",
            DROP_DEVICE,
            "type",
            "veth",
            "peer",
            "name",
            DROP_PEER,
        ])?;
        self.ip(&["-n", netns, "link", "set", DROP_DEVICE, "up"])?;
        self.ip(&["-n", netns, "link", "set", DROP_PEER, "up"])?;
        Ok(())
    }

    /// What the impairments did, summed over the nodes: from the qdiscs' and the loss
    /// filter's statistics and each namespace's TCP counters.
    pub fn counters(&self) -> Result<Counters, String> {
        let mut counters = Counters::default();
        for node in &self.nodes {
            if let Some(tc) = &self.tools.tc {
                let qdiscs =
                    self.tc(tc, &node.name, &["-s", "qdisc", "show", "dev", NODE_DEVICE])?;
                for stats in qdiscs.lines().filter_map(parse_sent_line) {
                    counters.qdisc_dropped += stats.dropped;
                    counters.qdisc_overlimits += stats.overlimits;
                }
                if let Some(filter) = self.loss_filter {
                    let filters = self.tc(
                        tc,
                        &node.name,
                        &["-s", "filter", "show", "dev", NODE_DEVICE, "ingress"],
                    )?;
                    for stats in filters.lines().filter_map(parse_sent_line) {
                        // gact passes most packets and counts the dropped ones; mirred
                        // takes only the matched ones, every one of them lost.
                        counters.filter_dropped += match filter {
                            LossFilter::Gact { .. } => stats.dropped,
                            LossFilter::IdBits { .. } => stats.packets,
                        };
                    }
                }
            }
            // /proc/net is the reader's namespace's: read from inside the node's.
            let snmp = self.ip(&["netns", "exec", &node.name, "cat", "/proc/net/snmp"])?;
            counters.tcp_retransmitted +=
                tcp_counter(&snmp, "RetransSegs").ok_or("no Tcp RetransSegs in /proc/net/snmp")?;
        }
        Ok(counters)
    }

    /// Namespaces of this run that `ip netns list` still shows.
    pub fn leftovers(ip: &Path, prefix: &str) -> Result<Vec<String>, String> {
        let list = run(ip, &["netns", "list"])?;
        Ok(list
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|name| name.starts_with(prefix))
            .map(str::to_string)
            .collect())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Nodes first, the hub last; each namespace's devices (and the veths' far ends in
        // the hub) go with it.
        let mut failures = String::new();
        for name in self.created.iter().rev() {
            if let Err(error) = run(&self.tools.ip, &["netns", "del", name]) {
                let _ = write!(failures, " {error};");
            }
        }
        match Lab::leftovers(&self.tools.ip, &self.prefix) {
            Ok(left) if left.is_empty() && failures.is_empty() => {}
            Ok(left) => eprintln!(
                "fluxgate: tearing down the namespaces failed:{failures} still there: {} \
                 (remove them with `ip netns del NAME`)",
                if left.is_empty() {
                    "none".to_string()
                } else {
                    left.join(" ")
                }
            ),
            Err(error) => eprintln!(
                "fluxgate: cannot check the namespaces `{}*` are gone: {error}",
                self.prefix
            ),
        }
    }
}

/// A random cluster secret (32 bytes, hex) in a file only its owner may read, removed when
/// dropped: the nodes bind non-loopback addresses, so their connections authenticate.
#[derive(Debug)]
pub struct SecretFile {
    path: PathBuf,
}

impl SecretFile {
    /// Writes a fresh secret to `dir/cluster.secret` (mode 0600, never an existing file).
    pub fn create(dir: &Path) -> Result<Self, String> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt;
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| format!("no randomness for the secret: {e}"))?;
        let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let path = dir.join("cluster.secret");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("cannot create the secret file `{}`: {e}", path.display()))?;
        // From here on, a failure still removes the file (on drop).
        let secret = Self { path };
        file.write_all(text.as_bytes())
            .map_err(|e| format!("cannot write `{}`: {e}", secret.path.display()))?;
        Ok(secret)
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What the impairments did during a run, summed over the nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Packets the loss filter (gact or u32 + mirred) dropped.
    pub filter_dropped: u64,
    /// Packets the qdiscs dropped (netem's loss, queues overflowing).
    pub qdisc_dropped: u64,
    /// Times a qdisc held a packet back for the rate.
    pub qdisc_overlimits: u64,
    /// TCP segments sent again.
    pub tcp_retransmitted: u64,
}

/// The numbers of a tc statistics line: `Sent B bytes P pkt (dropped D, overlimits O ...`.
#[derive(Debug, PartialEq, Eq)]
struct SentLine {
    packets: u64,
    dropped: u64,
    overlimits: u64,
}

fn parse_sent_line(line: &str) -> Option<SentLine> {
    let words: Vec<&str> = line
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
        .filter(|w| !w.is_empty())
        .collect();
    if words.first() != Some(&"Sent") {
        return None;
    }
    let after = |name: &str| -> Option<u64> {
        let at = words.iter().position(|w| *w == name)?;
        words.get(at + 1)?.parse().ok()
    };
    let before = |name: &str| -> Option<u64> {
        let at = words.iter().position(|w| *w == name)?;
        words.get(at.checked_sub(1)?)?.parse().ok()
    };
    Some(SentLine {
        packets: before("pkt")?,
        dropped: after("dropped")?,
        overlimits: after("overlimits")?,
    })
}

/// One counter of the `Tcp:` lines (names, then values) of /proc/net/snmp.
fn tcp_counter(snmp: &str, name: &str) -> Option<u64> {
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let names = tcp.next()?;
    let values = tcp.next()?;
    let at = names.split_whitespace().position(|n| n == name)?;
    values.split_whitespace().nth(at)?.parse().ok()
}

fn to_refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn qdisc_root(kind: &str) -> Vec<String> {
    [
        "qdisc",
        "add",
        "dev",
        NODE_DEVICE,
        "root",
        "handle",
        "1:",
        kind,
    ]
    .map(str::to_string)
    .to_vec()
}

/// One netem qdisc for all of it (netem has its own rate limit); a long queue, as the
/// default 1000 packets would drop on its own at delay × rate beyond that.
fn netem_args(i: &Impairments) -> Vec<String> {
    let mut args = qdisc_root("netem");
    args.extend(["limit".to_string(), "100000".to_string()]);
    if i.delay_ms > 0.0 || i.jitter_ms > 0.0 {
        args.extend([
            "delay".to_string(),
            format!("{}ms", i.delay_ms),
            format!("{}ms", i.jitter_ms),
        ]);
    }
    if i.loss_pct > 0.0 {
        args.extend(["loss".to_string(), format!("{}%", i.loss_pct)]);
    }
    if let Some(rate) = i.rate_mbit {
        args.extend(["rate".to_string(), format!("{rate}mbit")]);
    }
    args
}

fn describe_netem(i: &Impairments) -> String {
    let mut parts = Vec::new();
    if i.delay_ms > 0.0 || i.jitter_ms > 0.0 {
        parts.push(format!(
            "delay {} ms ± {} ms per direction",
            i.delay_ms, i.jitter_ms
        ));
    }
    if i.loss_pct > 0.0 {
        parts.push(format!("loss {}% sent", i.loss_pct));
    }
    if let Some(rate) = i.rate_mbit {
        parts.push(format!("rate {rate} Mbit/s sent per node"));
    }
    format!("{} (tc netem)", parts.join(", "))
}

/// tbf with a bucket of at least 64 KiB (one GSO packet passes whole) or 10 ms at the rate,
/// and up to 50 ms of queue.
fn tbf_args(rate_mbit: f64) -> Vec<String> {
    let burst = ((rate_mbit * 1e6 / 8.0 / 100.0) as u64).max(64 * 1024);
    let mut args = qdisc_root("tbf");
    args.extend([
        "rate".to_string(),
        format!("{rate_mbit}mbit"),
        "burst".to_string(),
        burst.to_string(),
        "latency".to_string(),
        "50ms".to_string(),
    ]);
    args
}

fn loss_filter_args(filter: LossFilter) -> Vec<String> {
    let mut args: Vec<String> = ["filter", "add", "dev", NODE_DEVICE, "ingress", "protocol"]
        .map(str::to_string)
        .to_vec();
    match filter {
        // Pass, but 1 in `one_in` packets (at random) drop.
        LossFilter::Gact { one_in } => args.extend(
            [
                "all", "u32", "match", "u32", "0", "0", "action", "gact", "pass", "random",
                "netrand", "drop",
            ]
            .map(str::to_string)
            .into_iter()
            .chain([one_in.to_string()]),
        ),
        // The identification is bytes 4-5 of the IPv4 header.
        LossFilter::IdBits { bits } => args.extend(
            ["ip", "u32", "match", "u16", "1"]
                .map(str::to_string)
                .into_iter()
                .chain([
                    format!("{:#x}", (1u32 << bits) - 1),
                    "at".to_string(),
                    "4".to_string(),
                    "action".to_string(),
                    "mirred".to_string(),
                    "egress".to_string(),
                    "redirect".to_string(),
                    "dev".to_string(),
                    DROP_DEVICE.to_string(),
                ]),
        ),
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (pid, ppid, pgrp) from a /proc/PID/stat line: `pid (comm) state ppid pgrp ...`, the
    /// fields counted after the command name, which may hold spaces and parentheses.
    fn pid_ppid_pgrp(stat: &str) -> (u32, u32, u32) {
        let (pid, rest) = stat.split_once(" (").expect("pid (comm)");
        let (_, after_comm) = rest.rsplit_once(") ").expect("(comm) state");
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        let number = |text: &str| text.trim().parse::<u32>().expect("a number");
        (number(pid), number(fields[1]), number(fields[2]))
    }

    /// A command `run` starts leads a process group of its own, so a Ctrl-C to this
    /// process's group (the terminal's foreground group) does not reach it.
    #[test]
    fn commands_run_in_a_process_group_of_their_own() {
        let cat = find_program("cat").expect("cat on PATH");
        let child = run(&cat, &["/proc/self/stat"]).expect("cat runs");
        let (child_pid, child_parent, child_group) = pid_ppid_pgrp(&child);
        let ours = std::fs::read_to_string("/proc/self/stat").expect("our own stat");
        let (our_pid, _, our_group) = pid_ppid_pgrp(&ours);
        assert_eq!(child_parent, our_pid, "cat is run's own child: {child}");
        assert_eq!(child_group, child_pid, "it leads its group: {child}");
        assert_ne!(child_group, our_group, "not in ours: {child} / {ours}");
    }

    #[test]
    fn subnets_parse() {
        assert_eq!(parse_subnet("10.77.3.0/24"), Ok([10, 77, 3]));
        assert_eq!(parse_subnet("10.77.3"), Ok([10, 77, 3]));
        assert!(parse_subnet("10.77.3.5/24").is_err());
        assert!(parse_subnet("10.77.3.0/16").is_err());
        assert!(parse_subnet("10.300.3.0").is_err());
        assert_eq!(subnet_for(0x1234), [10, 0x12, 0x34]);
    }

    #[test]
    fn commands_say_what_they_do() {
        let i = Impairments {
            delay_ms: 2.0,
            jitter_ms: 1.0,
            loss_pct: 1.0,
            rate_mbit: Some(100.0),
        };
        assert_eq!(
            netem_args(&i).join(" "),
            "qdisc add dev fg0 root handle 1: netem limit 100000 delay 2ms 1ms loss 1% rate 100mbit"
        );
        assert_eq!(
            tbf_args(100.0).join(" "),
            "qdisc add dev fg0 root handle 1: tbf rate 100mbit burst 125000 latency 50ms"
        );
        assert_eq!(
            loss_filter_args(LossFilter::Gact { one_in: 100 }).join(" "),
            "filter add dev fg0 ingress protocol all u32 match u32 0 0 action gact pass random netrand drop 100"
        );
        assert_eq!(
            loss_filter_args(LossFilter::IdBits { bits: 7 }).join(" "),
            "filter add dev fg0 ingress protocol ip u32 match u16 1 0x7f at 4 action mirred egress redirect dev fgdrop"
        );
    }

    #[test]
    fn statistics_parse() {
        assert_eq!(
            parse_sent_line(" Sent 49232232 bytes 33988 pkt (dropped 5, overlimits 7 requeues 0) "),
            Some(SentLine {
                packets: 33988,
                dropped: 5,
                overlimits: 7
            })
        );
        assert_eq!(parse_sent_line(" backlog 0b 0p requeues 0"), None);
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
                    Tcp: RtoAlgorithm RtoMin RetransSegs InErrs\nTcp: 1 200 17 0\n";
        assert_eq!(tcp_counter(snmp, "RetransSegs"), Some(17));
        assert_eq!(tcp_counter(snmp, "Nope"), None);
    }

    #[test]
    fn bad_impairments_are_refused() {
        let ok = Impairments {
            delay_ms: 0.0,
            jitter_ms: 0.0,
            loss_pct: 0.0,
            rate_mbit: None,
        };
        assert!(ok.validate().is_ok());
        assert!(Impairments {
            loss_pct: 100.0,
            ..ok
        }
        .validate()
        .is_err());
        assert!(Impairments {
            delay_ms: -1.0,
            ..ok
        }
        .validate()
        .is_err());
        assert!(Impairments {
            rate_mbit: Some(0.0),
            ..ok
        }
        .validate()
        .is_err());
    }
}
