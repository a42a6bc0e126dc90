//! Topology files of `fluxgate cluster`, `node` and `stress`: a job graph of stages (generator,
//! pass-through, verifying sink) joined by edges with a partitioner, placed on the nodes of a
//! loopback (or real) cluster.
//!
//! ```toml
//! [cluster]
//! nodes = 3            # processes
//! base_port = 0        # 0: every node picks a free port; N: node i listens on N + i
//!
//! [network]            # Flink option names, passed to NetworkConfig::set
//! "taskmanager.memory.segment-size" = "32kb"
//!
//! [checkpoints]        # optional: barriers injected by the generators
//! interval_ms = 200
//! mode = "aligned"     # aligned | unaligned | mixed | aligned-timeout
//!
//! [[stage]]
//! name = "source"
//! kind = "generator"   # generator | pass-through | sink
//! parallelism = 3
//! records = 100000     # per subtask (or duration_ms, or both: whichever ends first)
//! record_size = 64     # bytes, header included (or min_size / max_size)
//!
//! [[edge]]
//! from = "source"
//! to = "sink"
//! partitioner = "rebalance"   # forward | rebalance | hash | broadcast
//! buffer_timeout_ms = 10      # -1, 0, N; or a list, producer subtask i taking entry i % len
//! ```
//!
//! Records are `[producer u32 | sequence u64 | payload]` (big-endian), where `producer` is the
//! generator subtask's job-wide id (the stage's first id plus the subtask index) and the
//! payload repeats an 8-byte word derived from (producer, sequence), so a sink can check every
//! byte. Subtask `i` of a stage whose first id is `o` runs on node `(o + i) % nodes`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::Path;
use std::time::Duration;

use fluxgate::buffer::LocalPoolSpec;
use fluxgate::config::ConfigError;
use fluxgate::io::Transport;
use fluxgate::partition::{BufferTimeout, ResultPartitionId};
use fluxgate::NetworkConfig;
use serde::{Deserialize, Serialize};

/// Bytes of a record's header: producer id (u32) and sequence number (u64).
pub const HEADER: usize = 12;

/// Most nodes of one cluster.
const MAX_NODES: usize = 256;
/// Most subtasks of one stage.
pub(crate) const MAX_PARALLELISM: usize = 4096;

// ---------------------------------------------------------------------------------------------
// The file as written.

/// A topology file as written (also what `stress` writes for its nodes).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyFile {
    /// `[cluster]`.
    pub cluster: ClusterSection,
    /// `[network]`: Flink option names and values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub network: BTreeMap<String, toml::Value>,
    /// `[checkpoints]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<CheckpointSection>,
    /// `[[stage]]`.
    #[serde(default, rename = "stage")]
    pub stages: Vec<StageSection>,
    /// `[[edge]]`.
    #[serde(default, rename = "edge")]
    pub edges: Vec<EdgeSection>,
}

/// `[cluster]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Node processes.
    pub nodes: usize,
    /// 0: automatic ports; N: node i listens on N + i.
    #[serde(default)]
    pub base_port: u16,
    /// auto | uring | epoll.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
}

/// `[checkpoints]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Milliseconds between two barriers a generator injects.
    pub interval_ms: u64,
    /// How barriers align.
    #[serde(default)]
    pub mode: CheckpointMode,
}

/// How checkpoint barriers are aligned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointMode {
    /// Aligned barriers (channels block until every channel delivered the barrier).
    #[default]
    Aligned,
    /// Unaligned barriers (priority events overtaking the data).
    Unaligned,
    /// Odd checkpoints aligned, even ones unaligned.
    Mixed,
    /// Aligned barriers with Flink's alignment timeout ([`ALIGNED_CHECKPOINT_TIMEOUT_MS`]):
    /// a consumer still aligning that long after the checkpoint started turns it unaligned.
    AlignedTimeout,
}

/// The alignment timeout of `aligned-timeout` checkpoints, in milliseconds: short, so that a
/// slow or back-pressured consumer passes it and the switch to unaligned is exercised.
pub const ALIGNED_CHECKPOINT_TIMEOUT_MS: u64 = 5;

/// What a stage does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StageKind {
    /// Emits numbered records.
    Generator,
    /// Forwards every record unchanged.
    #[serde(alias = "pass_through", alias = "passthrough")]
    PassThrough,
    /// Verifies what it receives.
    Sink,
}

impl StageKind {
    /// The name as written in files.
    pub fn name(self) -> &'static str {
        match self {
            StageKind::Generator => "generator",
            StageKind::PassThrough => "pass-through",
            StageKind::Sink => "sink",
        }
    }
}

/// How an edge spreads records over the consumer's subtasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Partitioner {
    /// Producer subtask i to consumer subtask i (equal parallelism).
    Forward,
    /// Round robin over the consumers.
    #[serde(alias = "round-robin")]
    Rebalance,
    /// By a hash of (producer, sequence), through Flink's key groups.
    Hash,
    /// Every record to every consumer subtask.
    Broadcast,
}

impl Partitioner {
    /// The name as written in files.
    pub fn name(self) -> &'static str {
        match self {
            Partitioner::Forward => "forward",
            Partitioner::Rebalance => "rebalance",
            Partitioner::Hash => "hash",
            Partitioner::Broadcast => "broadcast",
        }
    }
}

/// `[[stage]]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSection {
    /// Unique name.
    pub name: String,
    /// generator | pass-through | sink.
    pub kind: StageKind,
    /// Subtasks.
    pub parallelism: usize,
    /// Generator: records per subtask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records: Option<u64>,
    /// Generator: milliseconds of emitting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Generator: bytes per record, header included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record_size: Option<usize>,
    /// Generator: smallest record (random sizes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_size: Option<usize>,
    /// Generator: largest record (random sizes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size: Option<usize>,
    /// Pass-through or sink: microseconds of work per record (a slow consumer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_us: Option<u64>,
    /// Which subtasks `delay_us` slows (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_subtasks: Option<Vec<usize>>,
}

/// One value or a list (per producer subtask).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// The same value for every producer subtask.
    One(i64),
    /// Producer subtask i takes entry i % len.
    Many(Vec<i64>),
}

/// `[[edge]]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeSection {
    /// Producing stage.
    pub from: String,
    /// Consuming stage.
    pub to: String,
    /// forward | rebalance | hash | broadcast.
    pub partitioner: Partitioner,
    /// `execution.buffer-timeout` of the producers' writers (default 100 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer_timeout_ms: Option<OneOrMany>,
}

// ---------------------------------------------------------------------------------------------
// The validated topology.

/// Barrier injection.
#[derive(Clone, Copy, Debug)]
pub struct Checkpoints {
    /// Between two barriers.
    pub interval: Duration,
    /// How they align.
    pub mode: CheckpointMode,
}

/// What a generator emits.
#[derive(Clone, Copy, Debug)]
pub struct Generator {
    /// Records per subtask, if bounded by count.
    pub records: Option<u64>,
    /// Emitting time, if bounded by time.
    pub duration: Option<Duration>,
    /// Smallest record, header included.
    pub min_size: usize,
    /// Largest record, header included.
    pub max_size: usize,
}

/// A validated stage.
#[derive(Clone, Debug)]
pub struct Stage {
    /// Unique name.
    pub name: String,
    /// What it does.
    pub kind: StageKind,
    /// Subtasks.
    pub parallelism: usize,
    /// Job-wide id of subtask 0 (also its placement offset).
    pub offset: usize,
    /// Generator settings.
    pub generator: Option<Generator>,
    /// Work per record on the slow subtasks.
    pub delay: Duration,
    /// Subtasks slowed by `delay` (all when `None`).
    pub slow_subtasks: Option<Vec<usize>>,
    /// Edges in.
    pub inputs: Vec<usize>,
    /// Edges out.
    pub outputs: Vec<usize>,
}

impl Stage {
    /// The per-record delay of `subtask`.
    pub fn delay_of(&self, subtask: usize) -> Duration {
        match &self.slow_subtasks {
            Some(list) if !list.contains(&subtask) => Duration::ZERO,
            _ => self.delay,
        }
    }
}

/// A validated edge.
#[derive(Clone, Debug)]
pub struct Edge {
    /// Producing stage index.
    pub from: usize,
    /// Consuming stage index.
    pub to: usize,
    /// How records spread.
    pub partitioner: Partitioner,
    /// Buffer timeouts (ms), producer subtask i takes entry i % len.
    pub buffer_timeouts: Vec<i64>,
}

/// One channel of a consumer subtask's gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputChannel {
    /// The edge it belongs to.
    pub edge: usize,
    /// The producer subtask (of the edge's `from` stage).
    pub producer: usize,
    /// The subpartition consumed.
    pub subpartition: usize,
}

/// A validated topology with everything derived from it that nodes and the verifier share.
#[derive(Clone, Debug)]
pub struct Topology {
    /// Node processes.
    pub nodes: usize,
    /// 0 or the first node's port.
    pub base_port: u16,
    /// The driver.
    pub transport: Transport,
    /// Network options.
    pub network: NetworkConfig,
    /// True when `taskmanager.memory.network.max` was given (else nodes size it to fit).
    pub network_memory_given: bool,
    /// Barrier injection.
    pub checkpoints: Option<Checkpoints>,
    /// Stages in file order.
    pub stages: Vec<Stage>,
    /// Edges in file order.
    pub edges: Vec<Edge>,
    /// Stage indexes, producers before consumers.
    pub order: Vec<usize>,
    /// `multiplicity[s][g]`: how many copies of each record of generator stage `g` the
    /// subtasks of stage `s` receive together (broadcast edges multiply, paths add up).
    pub multiplicity: Vec<Vec<u64>>,
    /// `ordered[s][i]`: the generator ids whose records subtask `i` of stage `s` processes in
    /// strictly increasing sequence order (sorted). Records of one producer that reach a
    /// subtask over two channels interleave freely, so their order is not checked downstream.
    ordered: Vec<Vec<Vec<u32>>>,
}

impl Topology {
    /// Reads, parses and validates a topology file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read topology file `{}`: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("topology file `{}`: {e}", path.display()))
    }

    /// Parses and validates topology text.
    pub fn parse(text: &str) -> Result<Self, String> {
        // toml's messages carry the line, a snippet and a caret.
        let file: TopologyFile =
            toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        Self::from_file(&file)
    }

    /// Validates a parsed file.
    pub fn from_file(file: &TopologyFile) -> Result<Self, String> {
        let nodes = file.cluster.nodes;
        if nodes == 0 || nodes > MAX_NODES {
            return Err(format!(
                "[cluster] nodes = {nodes}: must be from 1 to {MAX_NODES}"
            ));
        }
        if file.cluster.base_port != 0 && usize::from(file.cluster.base_port) + nodes > 65536 {
            return Err(format!(
                "[cluster] base_port = {}: ports up to base_port + nodes - 1 must exist",
                file.cluster.base_port
            ));
        }
        let transport = match &file.cluster.transport {
            None => Transport::Auto,
            Some(name) => name
                .parse::<Transport>()
                .map_err(|e| format!("[cluster] transport: {e}"))?,
        };

        let mut network = NetworkConfig::default();
        let mut options = Vec::with_capacity(file.network.len());
        for (key, value) in &file.network {
            let text = crate::config_file::option_text(value)
                .map_err(|refused| format!("[network] `{key}`: {refused}"))?;
            options.push((key.clone(), text));
        }
        // All at once: the relations between options are checked after every one is set.
        network.set_all(options).map_err(|e| match e {
            ConfigError::UnknownOption(_) => format!(
                "[network] {e} (known options: {})",
                NetworkConfig::OPTIONS.join(", ")
            ),
            _ => format!("[network] {e}"),
        })?;
        let network_memory_given = file.network.contains_key("taskmanager.memory.network.max");

        let checkpoints = match &file.checkpoints {
            None => None,
            Some(c) if c.interval_ms == 0 => {
                return Err("[checkpoints] interval_ms must be at least 1".into())
            }
            Some(c) => Some(Checkpoints {
                interval: Duration::from_millis(c.interval_ms),
                mode: c.mode,
            }),
        };

        if file.stages.is_empty() {
            return Err("no [[stage]]: a topology needs at least a generator and a sink".into());
        }
        let mut stages = Vec::with_capacity(file.stages.len());
        let mut names = BTreeMap::new();
        let mut offset = 0usize;
        for (index, s) in file.stages.iter().enumerate() {
            let stage = validate_stage(s, offset, network.max_record_bytes)?;
            if names.insert(s.name.clone(), index).is_some() {
                return Err(format!("stage `{}` is defined twice", s.name));
            }
            offset += stage.parallelism;
            stages.push(stage);
        }
        if offset > u32::MAX as usize {
            return Err("too many subtasks".into());
        }

        let mut edges = Vec::with_capacity(file.edges.len());
        for (index, e) in file.edges.iter().enumerate() {
            let what = format!("edge {} (`{}` -> `{}`)", index + 1, e.from, e.to);
            let lookup = |name: &str| {
                names.get(name).copied().ok_or_else(|| {
                    format!(
                        "{what}: unknown stage `{name}` (stages: {})",
                        file.stages
                            .iter()
                            .map(|s| format!("`{}`", s.name))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })
            };
            let from = lookup(&e.from)?;
            let to = lookup(&e.to)?;
            if from == to {
                return Err(format!("{what}: a stage cannot feed itself"));
            }
            if stages[from].kind == StageKind::Sink {
                return Err(format!(
                    "{what}: `{}` is a sink; sinks have no outputs",
                    e.from
                ));
            }
            if stages[to].kind == StageKind::Generator {
                return Err(format!(
                    "{what}: `{}` is a generator; generators have no inputs",
                    e.to
                ));
            }
            if e.partitioner == Partitioner::Forward
                && stages[from].parallelism != stages[to].parallelism
            {
                return Err(format!(
                    "{what}: partitioner forward needs equal parallelism, but `{}` has {} and `{}` has {}",
                    e.from, stages[from].parallelism, e.to, stages[to].parallelism
                ));
            }
            let buffer_timeouts = match &e.buffer_timeout_ms {
                None => vec![100],
                Some(OneOrMany::One(ms)) => vec![*ms],
                Some(OneOrMany::Many(list)) if list.is_empty() => {
                    return Err(format!("{what}: buffer_timeout_ms is an empty list"))
                }
                Some(OneOrMany::Many(list)) => list.clone(),
            };
            if let Some(bad) = buffer_timeouts.iter().find(|ms| **ms < -1) {
                return Err(format!(
                    "{what}: buffer_timeout_ms = {bad}: must be -1 (only full buffers), 0 (every record) or a positive number of ms"
                ));
            }
            stages[from].outputs.push(index);
            stages[to].inputs.push(index);
            edges.push(Edge {
                from,
                to,
                partitioner: e.partitioner,
                buffer_timeouts,
            });
        }

        for stage in &stages {
            match stage.kind {
                StageKind::Generator if stage.outputs.is_empty() => {
                    return Err(format!(
                        "generator `{}` has no outgoing [[edge]]",
                        stage.name
                    ))
                }
                StageKind::PassThrough if stage.inputs.is_empty() || stage.outputs.is_empty() => {
                    return Err(format!(
                        "pass-through `{}` needs an incoming and an outgoing [[edge]]",
                        stage.name
                    ))
                }
                StageKind::Sink if stage.inputs.is_empty() => {
                    return Err(format!("sink `{}` has no incoming [[edge]]", stage.name))
                }
                _ => {}
            }
        }
        if !stages.iter().any(|s| s.kind == StageKind::Sink) {
            return Err("no sink stage: nothing would verify the records".into());
        }

        let order = topological_order(&stages, &edges)?;
        let mut topology = Topology {
            nodes,
            base_port: file.cluster.base_port,
            transport,
            network,
            network_memory_given,
            checkpoints,
            stages,
            edges,
            order,
            multiplicity: Vec::new(),
            ordered: Vec::new(),
        };
        topology.multiplicity = topology.compute_multiplicity();
        topology.ordered = topology.compute_order();
        Ok(topology)
    }

    /// The node subtask `subtask` of `stage` runs on.
    pub fn node_of(&self, stage: usize, subtask: usize) -> usize {
        (self.stages[stage].offset + subtask) % self.nodes
    }

    /// The job-wide id of a subtask (the producer id in its records).
    pub fn origin(&self, stage: usize, subtask: usize) -> u32 {
        (self.stages[stage].offset + subtask) as u32
    }

    /// The (stage, subtask) of a job-wide id.
    pub fn subtask_of_origin(&self, origin: u32) -> Option<(usize, usize)> {
        let origin = origin as usize;
        self.stages
            .iter()
            .position(|s| (s.offset..s.offset + s.parallelism).contains(&origin))
            .map(|stage| (stage, origin - self.stages[stage].offset))
    }

    /// Subpartitions of each producer's partition of `edge`.
    pub fn subpartitions(&self, edge: usize) -> usize {
        let e = &self.edges[edge];
        match e.partitioner {
            // The forward selector always writes subpartition 0: one consumer per producer.
            Partitioner::Forward => 1,
            _ => self.stages[e.to].parallelism,
        }
    }

    /// The partition producer subtask `producer` writes for `edge`.
    pub fn partition_id(&self, edge: usize, producer: usize) -> ResultPartitionId {
        ResultPartitionId {
            partition: edge as u64,
            producer: producer as u64,
        }
    }

    /// The consumer subtasks producer `producer` of `edge` sends to (subpartition order).
    pub fn targets(&self, edge: usize, producer: usize) -> Vec<usize> {
        match self.edges[edge].partitioner {
            Partitioner::Forward => vec![producer],
            _ => (0..self.stages[self.edges[edge].to].parallelism).collect(),
        }
    }

    /// The channels of subtask `subtask` of `stage`, input edges in file order.
    pub fn input_channels(&self, stage: usize, subtask: usize) -> Vec<InputChannel> {
        let mut channels = Vec::new();
        for &edge in &self.stages[stage].inputs {
            let e = &self.edges[edge];
            match e.partitioner {
                Partitioner::Forward => channels.push(InputChannel {
                    edge,
                    producer: subtask,
                    subpartition: 0,
                }),
                _ => channels.extend((0..self.stages[e.from].parallelism).map(|producer| {
                    InputChannel {
                        edge,
                        producer,
                        subpartition: subtask,
                    }
                })),
            }
        }
        channels
    }

    /// The other nodes node `node` exchanges data with (ascending): those holding a subtask
    /// that produces to, or consumes from, one of its subtasks. A node with no subtask, or
    /// whose subtasks are linked only among themselves, has none.
    pub fn linked_nodes(&self, node: usize) -> Vec<usize> {
        let mut linked = BTreeSet::new();
        for (s, stage) in self.stages.iter().enumerate() {
            for subtask in 0..stage.parallelism {
                if self.node_of(s, subtask) != node {
                    continue;
                }
                for &edge in &stage.outputs {
                    let to = self.edges[edge].to;
                    let consumers = self.targets(edge, subtask);
                    linked.extend(consumers.into_iter().map(|c| self.node_of(to, c)));
                }
                let channels = self.input_channels(s, subtask);
                linked.extend(
                    channels
                        .iter()
                        .map(|c| self.node_of(self.edges[c.edge].from, c.producer)),
                );
            }
        }
        linked.remove(&node);
        linked.into_iter().collect()
    }

    /// The buffer timeout of producer `producer` on `edge`.
    pub fn buffer_timeout(&self, edge: usize, producer: usize) -> BufferTimeout {
        let list = &self.edges[edge].buffer_timeouts;
        BufferTimeout::from_millis(list[producer % list.len()])
    }

    /// Whether subtask `subtask` of `stage` forwards records of generator `origin` in
    /// strictly increasing sequence order.
    pub fn in_order(&self, stage: usize, subtask: usize, origin: u32) -> bool {
        self.ordered[stage][subtask].binary_search(&origin).is_ok()
    }

    /// Length of record `seq` of generator `origin` (None: not a generator id).
    pub fn record_len(&self, origin: u32, seq: u64) -> Option<usize> {
        let (stage, _) = self.subtask_of_origin(origin)?;
        let generator = self.stages[stage].generator.as_ref()?;
        Some(generator_len(generator, origin, seq))
    }

    /// Segments the local pools of node `node` may hold at most (its partitions' and gates'
    /// maximum pool sizes, as the library sizes them).
    pub fn segments_needed(&self, node: usize) -> usize {
        let mut segments = 0;
        for (s, stage) in self.stages.iter().enumerate() {
            for subtask in 0..stage.parallelism {
                if self.node_of(s, subtask) != node {
                    continue;
                }
                for &edge in &stage.outputs {
                    let spec =
                        LocalPoolSpec::for_partition(self.subpartitions(edge), &self.network);
                    segments += spec.max_segments;
                }
                let remote = self
                    .input_channels(s, subtask)
                    .iter()
                    .filter(|c| self.node_of(self.edges[c.edge].from, c.producer) != node)
                    .count();
                if remote > 0 {
                    segments += LocalPoolSpec::for_gate(remote, &self.network).max_segments;
                }
            }
        }
        segments
    }

    /// Records each sink stage must receive from one subtask of generator stage `g` that
    /// emitted `emitted` records.
    pub fn expected_copies(&self, sink: usize, generator: usize) -> u64 {
        self.multiplicity[sink][generator]
    }

    fn compute_multiplicity(&self) -> Vec<Vec<u64>> {
        let n = self.stages.len();
        let mut m = vec![vec![0u64; n]; n];
        for &s in &self.order {
            if self.stages[s].kind == StageKind::Generator {
                m[s][s] = 1;
            }
            for &edge in &self.stages[s].inputs {
                let e = &self.edges[edge];
                let factor = match e.partitioner {
                    Partitioner::Broadcast => self.stages[s].parallelism as u64,
                    _ => 1,
                };
                let upstream = m[e.from].clone();
                for (total, copies) in m[s].iter_mut().zip(upstream) {
                    *total = total.saturating_add(copies.saturating_mul(factor));
                }
            }
        }
        m
    }

    fn compute_order(&self) -> Vec<Vec<Vec<u32>>> {
        let n = self.stages.len();
        // reach[s][i]: generator ids whose records may reach subtask i of stage s.
        let mut reach: Vec<Vec<Vec<u32>>> = vec![Vec::new(); n];
        let mut ordered: Vec<Vec<Vec<u32>>> = vec![Vec::new(); n];
        let origins = self.stages.iter().map(|s| s.parallelism).sum::<usize>();
        let mut count = vec![0u32; origins];
        let mut in_order = vec![false; origins];
        for &s in &self.order {
            let stage = &self.stages[s];
            for subtask in 0..stage.parallelism {
                if stage.kind == StageKind::Generator {
                    let me = self.origin(s, subtask);
                    reach[s].push(vec![me]);
                    ordered[s].push(vec![me]);
                    continue;
                }
                let mut seen = Vec::new();
                for channel in self.input_channels(s, subtask) {
                    let from = self.edges[channel.edge].from;
                    for &origin in &reach[from][channel.producer] {
                        let o = origin as usize;
                        if count[o] == 0 {
                            seen.push(origin);
                        }
                        count[o] += 1;
                        in_order[o] = ordered[from][channel.producer]
                            .binary_search(&origin)
                            .is_ok();
                    }
                }
                seen.sort_unstable();
                let keep: Vec<u32> = seen
                    .iter()
                    .copied()
                    .filter(|&o| count[o as usize] == 1 && in_order[o as usize])
                    .collect();
                for &o in &seen {
                    count[o as usize] = 0;
                    in_order[o as usize] = false;
                }
                reach[s].push(seen);
                ordered[s].push(keep);
            }
        }
        ordered
    }
}

fn validate_stage(s: &StageSection, offset: usize, max_record: usize) -> Result<Stage, String> {
    let what = format!("stage `{}`", s.name);
    if s.name.trim().is_empty() {
        return Err("a stage has an empty name".into());
    }
    if s.parallelism == 0 || s.parallelism > MAX_PARALLELISM {
        return Err(format!(
            "{what}: parallelism = {}: must be from 1 to {MAX_PARALLELISM}",
            s.parallelism
        ));
    }
    let generator_options = [
        ("records", s.records.is_some()),
        ("duration_ms", s.duration_ms.is_some()),
        ("record_size", s.record_size.is_some()),
        ("min_size", s.min_size.is_some()),
        ("max_size", s.max_size.is_some()),
    ];
    let generator = if s.kind == StageKind::Generator {
        if s.records.is_none() && s.duration_ms.is_none() {
            return Err(format!(
                "{what}: a generator needs `records` (per subtask) or `duration_ms`"
            ));
        }
        if s.duration_ms == Some(0) {
            return Err(format!("{what}: duration_ms must be at least 1"));
        }
        let (min_size, max_size) = match (s.record_size, s.min_size, s.max_size) {
            (Some(size), None, None) => (size, size),
            (None, Some(min), Some(max)) => (min, max),
            (None, None, None) => {
                return Err(format!(
                    "{what}: a generator needs `record_size` or `min_size` and `max_size`"
                ))
            }
            (Some(_), _, _) => {
                return Err(format!(
                    "{what}: `record_size` and `min_size`/`max_size` exclude each other"
                ))
            }
            _ => return Err(format!("{what}: `min_size` and `max_size` go together")),
        };
        if min_size < HEADER {
            return Err(format!(
                "{what}: records must be at least {HEADER} bytes (the producer id and sequence number), got {min_size}"
            ));
        }
        if min_size > max_size {
            return Err(format!(
                "{what}: min_size {min_size} is larger than max_size {max_size}"
            ));
        }
        if max_size > max_record {
            return Err(format!(
                "{what}: records of {max_size} bytes exceed fluxgate.record.max-size ({max_record})"
            ));
        }
        Some(Generator {
            records: s.records,
            duration: s.duration_ms.map(Duration::from_millis),
            min_size,
            max_size,
        })
    } else {
        if let Some((option, _)) = generator_options.iter().find(|(_, set)| *set) {
            return Err(format!(
                "{what}: `{option}` applies to generators only, this stage is a {}",
                s.kind.name()
            ));
        }
        None
    };
    if s.kind == StageKind::Generator && (s.delay_us.is_some() || s.slow_subtasks.is_some()) {
        return Err(format!(
            "{what}: `delay_us` and `slow_subtasks` apply to pass-through and sink stages"
        ));
    }
    if let Some(bad) = s
        .slow_subtasks
        .iter()
        .flatten()
        .find(|&&i| i >= s.parallelism)
    {
        return Err(format!(
            "{what}: slow_subtasks names subtask {bad}, but the parallelism is {}",
            s.parallelism
        ));
    }
    Ok(Stage {
        name: s.name.clone(),
        kind: s.kind,
        parallelism: s.parallelism,
        offset,
        generator,
        delay: Duration::from_micros(s.delay_us.unwrap_or(0)),
        slow_subtasks: s.slow_subtasks.clone(),
        inputs: Vec::new(),
        outputs: Vec::new(),
    })
}

/// Kahn's algorithm; a cycle is an error naming its stages.
fn topological_order(stages: &[Stage], edges: &[Edge]) -> Result<Vec<usize>, String> {
    let mut indegree: Vec<usize> = stages.iter().map(|s| s.inputs.len()).collect();
    let mut ready: Vec<usize> = (0..stages.len()).filter(|&s| indegree[s] == 0).collect();
    ready.reverse();
    let mut order = Vec::with_capacity(stages.len());
    while let Some(s) = ready.pop() {
        order.push(s);
        for &edge in &stages[s].outputs {
            let to = edges[edge].to;
            indegree[to] -= 1;
            if indegree[to] == 0 {
                ready.push(to);
            }
        }
    }
    if order.len() < stages.len() {
        // Left: the cycles and what hangs below them; peel off stages feeding no other left
        // stage until only the cycles remain.
        let mut left: HashSet<usize> = (0..stages.len()).collect();
        order.iter().for_each(|s| {
            left.remove(s);
        });
        loop {
            let leaf = left.iter().copied().find(|&s| {
                !stages[s]
                    .outputs
                    .iter()
                    .any(|&e| left.contains(&edges[e].to))
            });
            match leaf {
                Some(s) => left.remove(&s),
                None => break,
            };
        }
        let mut cycle: Vec<usize> = left.into_iter().collect();
        cycle.sort_unstable();
        let cycle: Vec<String> = cycle
            .into_iter()
            .map(|s| format!("`{}`", stages[s].name))
            .collect();
        return Err(format!(
            "the edges form a cycle through {}; a topology must be acyclic",
            cycle.join(", ")
        ));
    }
    Ok(order)
}

// ---------------------------------------------------------------------------------------------
// Records.

/// A 64-bit finalizer (splitmix64's).
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn generator_len(generator: &Generator, origin: u32, seq: u64) -> usize {
    if generator.min_size == generator.max_size {
        return generator.min_size;
    }
    let span = (generator.max_size - generator.min_size + 1) as u64;
    generator.min_size + (mix64(u64::from(origin) << 40 ^ seq ^ 0x5157) % span) as usize
}

/// The word a record's payload repeats.
pub fn payload_word(origin: u32, seq: u64) -> [u8; 8] {
    mix64((u64::from(origin) << 40) ^ seq ^ 0xA076_1D64_78BD_642F).to_le_bytes()
}

/// Writes record `seq` of generator `origin` into `out` (cleared first).
pub fn make_record(generator: &Generator, origin: u32, seq: u64, out: &mut Vec<u8>) {
    let len = generator_len(generator, origin, seq);
    out.clear();
    out.extend_from_slice(&origin.to_be_bytes());
    out.extend_from_slice(&seq.to_be_bytes());
    out.resize(len, 0);
    let word = payload_word(origin, seq);
    let mut chunks = out[HEADER..].chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&word);
    }
    let rest = chunks.into_remainder();
    let n = rest.len();
    rest.copy_from_slice(&word[..n]);
}

/// The (producer id, sequence) of a record, if it has a header.
pub fn record_header(record: &[u8]) -> Option<(u32, u64)> {
    if record.len() < HEADER {
        return None;
    }
    let origin = u32::from_be_bytes(record[..4].try_into().ok()?);
    let seq = u64::from_be_bytes(record[4..HEADER].try_into().ok()?);
    Some((origin, seq))
}

/// True when the payload is the pattern of (origin, seq).
pub fn payload_intact(record: &[u8], origin: u32, seq: u64) -> bool {
    let word = payload_word(origin, seq);
    let payload = &record[HEADER..];
    let mut chunks = payload.chunks_exact(8);
    for chunk in &mut chunks {
        if chunk != word {
            return false;
        }
    }
    let rest = chunks.remainder();
    rest == &word[..rest.len()]
}

/// A record's checksum: a hash of its producer, sequence, length and the first and last
/// payload bytes (sinks compare every payload byte with the pattern besides). Per producer
/// the checksums are summed (wrapping), so the sum of a multiset does not depend on order.
pub fn record_checksum(record: &[u8]) -> u64 {
    let mut h = record.len() as u64;
    let head = &record[..record.len().min(20)];
    let tail = &record[record.len().saturating_sub(8)..];
    for part in [head, tail] {
        for chunk in part.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            h = mix64(h ^ u64::from_le_bytes(word));
        }
    }
    h
}

/// The key a hash edge partitions by.
pub fn record_key(record: &[u8]) -> u64 {
    match record_header(record) {
        Some((origin, seq)) => mix64((u64::from(origin) << 40) ^ seq ^ 0x4B65_7921),
        None => 0,
    }
}

/// Key groups of a hash edge into `parallelism` subtasks (Flink's default max parallelism).
pub fn max_parallelism(parallelism: usize) -> usize {
    (parallelism + parallelism / 2)
        .next_power_of_two()
        .clamp(128, 32768)
}

/// A two-node topology for tests: 2 generators feeding 3 sinks by rebalance.
#[cfg(test)]
pub(crate) const TWO_NODE_TEST_TOPOLOGY: &str = r#"
[cluster]
nodes = 2

[[stage]]
name = "gen"
kind = "generator"
parallelism = 2
records = 10
record_size = 16

[[stage]]
name = "sink"
kind = "sink"
parallelism = 3

[[edge]]
from = "gen"
to = "sink"
partitioner = "rebalance"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = TWO_NODE_TEST_TOPOLOGY;

    #[test]
    fn base_parses() {
        let t = Topology::parse(BASE).unwrap();
        assert_eq!(t.order, vec![0, 1]);
        assert_eq!(t.input_channels(1, 2).len(), 2);
        assert_eq!(t.multiplicity[1][0], 1);
        assert!(t.in_order(1, 0, 0));
    }

    #[test]
    fn forward_with_unequal_parallelism_is_refused() {
        let text = BASE.replace("rebalance", "forward");
        let error = Topology::parse(&text).unwrap_err();
        assert!(error.contains("equal parallelism"), "{error}");
    }

    #[test]
    fn cycles_are_refused() {
        let text = r#"
[cluster]
nodes = 1
[[stage]]
name = "g"
kind = "generator"
parallelism = 1
records = 1
record_size = 12
[[stage]]
name = "a"
kind = "pass-through"
parallelism = 1
[[stage]]
name = "b"
kind = "pass-through"
parallelism = 1
[[stage]]
name = "s"
kind = "sink"
parallelism = 1
[[edge]]
from = "g"
to = "a"
partitioner = "rebalance"
[[edge]]
from = "a"
to = "b"
partitioner = "rebalance"
[[edge]]
from = "b"
to = "a"
partitioner = "rebalance"
[[edge]]
from = "b"
to = "s"
partitioner = "rebalance"
"#;
        let error = Topology::parse(text).unwrap_err();
        assert!(error.contains("cycle"), "{error}");
    }

    #[test]
    fn records_round_trip() {
        let t = Topology::parse(BASE).unwrap();
        let g = t.stages[0].generator.unwrap();
        let mut buf = Vec::new();
        make_record(&g, 1, 7, &mut buf);
        assert_eq!(buf.len(), 16);
        assert_eq!(record_header(&buf), Some((1, 7)));
        assert!(payload_intact(&buf, 1, 7));
        buf[13] ^= 1;
        assert!(!payload_intact(&buf, 1, 7));
    }

    #[test]
    fn linked_nodes_are_those_holding_a_producer_or_consumer_of_the_nodes_subtasks() {
        // Subtasks by offset: near-gen 0, far-gen 1, far-sink 2 and 3, near-sink 4.
        let text = r#"
[cluster]
nodes = 4
[[stage]]
name = "near-gen"
kind = "generator"
parallelism = 1
records = 1
record_size = 12
[[stage]]
name = "far-gen"
kind = "generator"
parallelism = 1
records = 1
record_size = 12
[[stage]]
name = "far-sink"
kind = "sink"
parallelism = 2
[[stage]]
name = "near-sink"
kind = "sink"
parallelism = 1
[[edge]]
from = "near-gen"
to = "near-sink"
partitioner = "forward"
[[edge]]
from = "far-gen"
to = "far-sink"
partitioner = "rebalance"
"#;
        // On four nodes near-gen and near-sink share node 0: it is linked to no other node.
        let t = Topology::parse(text).unwrap();
        assert_eq!(t.node_of(3, 0), 0);
        assert_eq!(t.linked_nodes(0), Vec::<usize>::new());
        assert_eq!(t.linked_nodes(1), vec![2, 3]);
        assert_eq!(t.linked_nodes(2), vec![1]);
        assert_eq!(t.linked_nodes(3), vec![1]);
        // On six, near-sink runs on node 4, and node 5 holds no subtask.
        let t = Topology::parse(&text.replace("nodes = 4", "nodes = 6")).unwrap();
        assert_eq!(t.linked_nodes(0), vec![4]);
        assert_eq!(t.linked_nodes(4), vec![0]);
        assert_eq!(t.linked_nodes(5), Vec::<usize>::new());
    }

    #[test]
    fn merged_paths_are_not_order_checked() {
        // gen -> rebalance -> a(2) -> rebalance -> b(2): b's subtasks get gen's records over
        // two channels, so b does not forward them in order.
        let text = r#"
[cluster]
nodes = 1
[[stage]]
name = "gen"
kind = "generator"
parallelism = 1
records = 1
record_size = 12
[[stage]]
name = "a"
kind = "pass-through"
parallelism = 2
[[stage]]
name = "b"
kind = "pass-through"
parallelism = 2
[[stage]]
name = "s"
kind = "sink"
parallelism = 1
[[edge]]
from = "gen"
to = "a"
partitioner = "rebalance"
[[edge]]
from = "a"
to = "b"
partitioner = "rebalance"
[[edge]]
from = "b"
to = "s"
partitioner = "broadcast"
"#;
        let t = Topology::parse(text).unwrap();
        assert!(t.in_order(1, 0, 0));
        assert!(!t.in_order(2, 0, 0));
        assert_eq!(t.multiplicity[3][0], 1);
    }
}
