//! Records through segments: any sequence of records of random sizes (empty to several
//! segments) survives serialize → deserialize byte-exact, across segment boundaries and partial
//! flushes; hostile lengths and truncated streams are typed errors.

use std::collections::VecDeque;

use fluxgate::buffer::{
    Buffer, BufferBuilder, BufferConsumer, LocalBufferPool, LocalPoolSpec, NetworkBufferPool,
};
use fluxgate::record::{
    self, RecordDeserializer, RecordError, RecordOutput, SegmentSink, SpanningBudget,
};
use fluxgate::NetworkConfig;
use proptest::prelude::*;

const SEGMENT: usize = 4096;

fn network() -> (NetworkBufferPool, NetworkConfig) {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.segment-size", "4kb")
        .unwrap();
    // Room for the property's worst case: 60 unread records of 4 segments each.
    config.set("taskmanager.memory.network.max", "1mb").unwrap();
    config.set("fluxgate.memory.arena-size", "128kb").unwrap();
    (NetworkBufferPool::new(&config).unwrap(), config)
}

/// A subpartition stand-in: buffers become visible on flush or when a segment fills, in order.
struct QueueSink<'a> {
    pool: &'a LocalBufferPool,
    current: Option<(BufferBuilder, BufferConsumer)>,
    out: VecDeque<Buffer>,
}

impl<'a> QueueSink<'a> {
    /// An empty sink writing into `pool`'s segments.
    fn new(pool: &'a LocalBufferPool) -> Self {
        Self {
            pool,
            current: None,
            out: VecDeque::new(),
        }
    }

    /// Makes what was committed so far visible without finishing the segment.
    fn flush(&mut self) {
        if let Some((_, consumer)) = self.current.as_mut() {
            let buffer = consumer.build();
            if !buffer.is_empty() {
                self.out.push_back(buffer);
            }
        }
    }

    fn finish(&mut self) {
        if let Some((mut builder, mut consumer)) = self.current.take() {
            builder.finish();
            let buffer = consumer.build();
            if !buffer.is_empty() {
                self.out.push_back(buffer);
            }
        }
    }
}

impl SegmentSink for QueueSink<'_> {
    fn writable(&mut self) -> Result<&mut BufferBuilder, RecordError> {
        if self.current.as_ref().is_some_and(|(b, _)| b.is_full()) {
            self.finish();
        }
        if self.current.is_none() {
            let builder = self
                .pool
                .request_buffer_builder(0)
                .expect("pool sized for the test");
            let consumer = builder.create_consumer_from_beginning();
            self.current = Some((builder, consumer));
        }
        Ok(&mut self.current.as_mut().unwrap().0)
    }

    fn commit(&mut self) {
        if let Some((builder, _)) = self.current.as_mut() {
            builder.commit();
        }
    }
}

/// Feeds every queued buffer to the deserializer and collects the records; with `batch`,
/// each record read singly is followed by up to `batch` records of the same buffer taken
/// as a batch ([`RecordDeserializer::whole_records`]).
fn drain(
    sink: &mut QueueSink<'_>,
    reader: &mut RecordDeserializer,
    got: &mut Vec<Vec<u8>>,
    batch: usize,
) {
    while let Some(buffer) = sink.out.pop_front() {
        reader.set_next_buffer(buffer).unwrap();
        while let Some(record) = reader.next_record().unwrap() {
            got.push(record.to_vec());
            got.extend(reader.whole_records().take(batch).map(<[u8]>::to_vec));
        }
    }
}

fn record_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 0..16),
        2 => prop::collection::vec(any::<u8>(), 0..SEGMENT + 100),
        1 => prop::collection::vec(any::<u8>(), 0..3 * SEGMENT + 7),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn records_survive_segment_boundaries_and_partial_flushes(
        steps in prop::collection::vec((record_bytes(), any::<bool>(), any::<bool>()), 0..60),
        batch in prop_oneof![Just(0usize), Just(1), Just(2), Just(usize::MAX)],
    ) {
        let (network, config) = network();
        let pool = network
            .create_local_pool(LocalPoolSpec {
                min_segments: 4,
                max_segments: 256,
                subpartitions: 1,
                max_segments_per_channel: 256,
                max_listeners: 1,
                max_overdraft_segments: usize::MAX,
            })
            .unwrap();
        let mut sink = QueueSink::new(&pool);
        let mut reader = RecordDeserializer::new(config.max_record_bytes);
        let mut got = Vec::new();
        let mut sent = Vec::new();
        for (bytes, flush, read_now) in steps {
            record::serialize(&bytes[..], &mut sink, config.max_record_bytes).unwrap();
            sent.push(bytes);
            if flush {
                sink.flush();
            }
            if read_now {
                drain(&mut sink, &mut reader, &mut got, batch);
            }
        }
        sink.finish();
        drain(&mut sink, &mut reader, &mut got, batch);
        prop_assert!(reader.finish().is_ok(), "no partial record left");
        prop_assert_eq!(got, sent);
        drop(sink);
        drop(pool);
        prop_assert_eq!(network.available_segments(), network.total_segments());
    }

    #[test]
    fn any_bytes_give_records_or_a_typed_error_never_a_panic(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..8),
    ) {
        let (network, _) = network();
        let mut reader = RecordDeserializer::new(1000);
        for chunk in chunks {
            let mut builder = network
                .request_segment()
                .unwrap()
                .into_builder(fluxgate::buffer::DataType::DataBuffer);
            let mut consumer = builder.create_consumer_from_beginning();
            builder.append_and_commit(&chunk);
            drop(builder);
            reader.set_next_buffer(consumer.build()).unwrap();
            loop {
                match reader.next_record() {
                    Ok(Some(record)) => prop_assert!(record.len() <= 1000),
                    Ok(None) => break,
                    Err(RecordError::TooLarge { len, max: 1000 }) => {
                        prop_assert!(len > 1000);
                        reader.clear();
                        break;
                    }
                    Err(RecordError::MalformedLength) => {
                        reader.clear();
                        break;
                    }
                    Err(other) => prop_assert!(false, "unexpected error {other}"),
                }
            }
        }
        reader.clear();
        prop_assert_eq!(network.available_segments(), network.total_segments());
    }
}

fn one_buffer(network: &NetworkBufferPool, bytes: &[u8]) -> Buffer {
    let mut builder = network
        .request_segment()
        .unwrap()
        .into_builder(fluxgate::buffer::DataType::DataBuffer);
    let mut consumer = builder.create_consumer_from_beginning();
    builder.append_and_commit(bytes);
    consumer.build()
}

#[test]
fn a_length_over_the_maximum_is_refused_before_any_allocation() {
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(64);
    reader
        .set_next_buffer(one_buffer(&network, &[0xFF, 0xFF, 0xFF, 0xFF, 0x0F]))
        .unwrap();
    assert_eq!(
        reader.next_record().unwrap_err(),
        RecordError::TooLarge {
            len: u32::MAX as usize,
            max: 64
        }
    );
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_batch_stops_before_a_record_over_the_maximum_which_the_next_read_refuses() {
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(16);
    // Records of 2, 3 and 20 bytes (one-byte prefixes), then one of 1.
    let mut bytes = vec![2, b'a', b'b', 3, b'c', b'd', b'e', 20];
    bytes.extend([b'x'; 20]);
    bytes.extend([1, b'z']);
    reader
        .set_next_buffer(one_buffer(&network, &bytes))
        .unwrap();
    assert_eq!(reader.next_record().unwrap(), Some(&b"ab"[..]));
    let batch: Vec<&[u8]> = reader.whole_records().collect();
    assert_eq!(batch, [&b"cde"[..]]);
    assert_eq!(
        reader.next_record().unwrap_err(),
        RecordError::TooLarge { len: 20, max: 16 }
    );
    assert_eq!(
        reader.whole_records().count(),
        0,
        "nothing after a refused length"
    );
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_batch_takes_records_with_longer_prefixes_and_stops_at_a_prefix_cut_by_the_buffer_end() {
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(1 << 20);
    let records: Vec<Vec<u8>> = [3usize, 200, 2_000, 0, 128]
        .iter()
        .map(|&len| vec![len as u8; len])
        .collect();
    let mut bytes = Vec::new();
    for record in &records {
        let mut prefix = [0; fluxgate::record::MAX_LENGTH_PREFIX];
        let used = fluxgate::record::encode_prefix(record.len() as u32, &mut prefix);
        bytes.extend_from_slice(&prefix[..used]);
        bytes.extend_from_slice(record);
    }
    // The first byte of 300's two-byte prefix ends the buffer.
    bytes.push(0xAC);
    let mut buffer = network
        .request_segment()
        .unwrap()
        .into_builder(fluxgate::buffer::DataType::DataBuffer);
    let mut consumer = buffer.create_consumer_from_beginning();
    assert_eq!(
        buffer.append_and_commit(&bytes),
        bytes.len(),
        "one 4 KiB segment"
    );
    drop(buffer);
    reader.set_next_buffer(consumer.build()).unwrap();
    assert_eq!(reader.next_record().unwrap(), Some(&records[0][..]));
    let batch: Vec<Vec<u8>> = reader.whole_records().map(<[u8]>::to_vec).collect();
    assert_eq!(batch, records[1..]);
    assert_eq!(
        reader.next_record().unwrap(),
        None,
        "the cut prefix is gathered"
    );
    drop((reader, consumer));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_batch_before_the_rest_of_a_split_length_prefix_is_empty() {
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(1 << 10);
    // "a", then the first byte of 200's two-byte prefix (0xC8 0x01); the second buffer
    // begins with the prefix's last byte, which a batch must not read as a length.
    reader
        .set_next_buffer(one_buffer(&network, &[1, b'a', 0xC8]))
        .unwrap();
    assert_eq!(reader.next_record().unwrap(), Some(&b"a"[..]));
    assert_eq!(reader.next_record().unwrap(), None);
    let mut second = vec![0x01];
    second.extend([b'r'; 200]);
    second.extend([1, b'q']);
    reader
        .set_next_buffer(one_buffer(&network, &second))
        .unwrap();
    assert_eq!(reader.whole_records().count(), 0);
    assert_eq!(reader.next_record().unwrap(), Some(&[b'r'; 200][..]));
    let batch: Vec<&[u8]> = reader.whole_records().collect();
    assert_eq!(batch, [&b"q"[..]]);
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_batch_before_the_rest_of_a_spanning_record_is_empty() {
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(1 << 10);
    // A record of 5 bytes, two in the first buffer; the rest (1, 2, 3) would read as a
    // record of one byte were a batch to take the second buffer from its start.
    reader
        .set_next_buffer(one_buffer(&network, &[5, b'a', b'b']))
        .unwrap();
    assert_eq!(reader.next_record().unwrap(), None);
    reader
        .set_next_buffer(one_buffer(&network, &[1, 2, 3, 1, b'q']))
        .unwrap();
    assert_eq!(reader.whole_records().count(), 0);
    assert_eq!(
        reader.next_record().unwrap(),
        Some(&[b'a', b'b', 1, 2, 3][..])
    );
    let batch: Vec<&[u8]> = reader.whole_records().collect();
    assert_eq!(batch, [&b"q"[..]]);
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_refused_length_split_across_buffers_stays_refused() {
    // 200 (a two-byte prefix: 0xC8 0x01) over a maximum of 64, the prefix split across two
    // buffers and followed by bytes that would read as small records. Every later call fails
    // the same way; none reads the refused record's bytes as records.
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(64);
    reader
        .set_next_buffer(one_buffer(&network, &[0xC8]))
        .unwrap();
    assert_eq!(reader.next_record().unwrap(), None);
    reader
        .set_next_buffer(one_buffer(&network, &[0x01, 3, b'a', b'b', b'c', 1, b'z']))
        .unwrap();
    for _ in 0..3 {
        assert_eq!(
            reader.next_record().unwrap_err(),
            RecordError::TooLarge { len: 200, max: 64 }
        );
        // The refused stream's buffer went back at once, not when the reader goes: it held
        // a segment (a channel's credit) it would never read.
        assert_eq!(network.available_segments(), network.total_segments());
    }
    // A later buffer of the refused stream is not read either, and not kept.
    assert_eq!(
        reader
            .set_next_buffer(one_buffer(&network, &[1, b'y']))
            .unwrap_err(),
        RecordError::TooLarge { len: 200, max: 64 }
    );
    assert_eq!(network.available_segments(), network.total_segments());
    assert_eq!(
        reader.next_record().unwrap_err(),
        RecordError::TooLarge { len: 200, max: 64 }
    );
    // Its end reports the refusal, and leaves the reader fit for a new stream.
    assert_eq!(
        reader.finish().unwrap_err(),
        RecordError::TooLarge { len: 200, max: 64 }
    );
    reader
        .set_next_buffer(one_buffer(&network, &[1, b'n']))
        .unwrap();
    assert_eq!(reader.next_record().unwrap(), Some(&b"n"[..]));
    assert_eq!(reader.next_record().unwrap(), None);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_length_no_u32_is_written_as_is_malformed() {
    let (network, _) = network();
    // Six bytes of continuation; a fifth byte with bits above the 32nd.
    for bytes in [
        &[0x80u8, 0x80, 0x80, 0x80, 0x80, 0x01][..],
        &[0xFF, 0xFF, 0xFF, 0xFF, 0x10],
    ] {
        let mut reader = RecordDeserializer::new(u32::MAX as usize);
        reader.set_next_buffer(one_buffer(&network, bytes)).unwrap();
        assert_eq!(
            reader.next_record().unwrap_err(),
            RecordError::MalformedLength,
            "{bytes:x?}"
        );
        assert_eq!(network.available_segments(), network.total_segments());
        assert_eq!(
            reader.next_record().unwrap_err(),
            RecordError::MalformedLength
        );
    }
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_length_prefix_split_over_three_buffers_is_gathered() {
    let (network, _) = network();
    // 20 000 is 0xA0 0x9C 0x01 as LEB128: one byte per buffer, then the body in two pieces.
    let body: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
    let mut pieces: Vec<&[u8]> = vec![&[0xA0], &[0x9C], &[0x01], &body[..7]];
    // The rest in pieces that fit the test network's segments.
    pieces.extend(body[7..].chunks(4000));
    let mut reader = RecordDeserializer::new(1 << 20);
    let mut records = Vec::new();
    for piece in pieces {
        reader.set_next_buffer(one_buffer(&network, piece)).unwrap();
        while let Some(record) = reader.next_record().unwrap() {
            records.push(record.to_vec());
        }
    }
    assert_eq!(records.len(), 1);
    assert!(records[0] == body, "the record's bytes differ");
    reader.finish().unwrap();
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_channel_that_carried_a_huge_record_gives_its_memory_back() {
    // A record of 1 MiB assembled across buffers, then small records each whole in one
    // buffer: the scratch kept the 1 MiB for as long as the reader lived (it shrank only
    // when a smaller record spanned buffers too). It is given back after 64 such buffers.
    let (network, _) = network();
    let huge: Vec<u8> = (0..1u32 << 20).map(|i| i as u8).collect();
    let mut framed = vec![0x80, 0x80, 0x40]; // 1 << 20 as LEB128
    framed.extend_from_slice(&huge);
    let mut reader = RecordDeserializer::new(2 << 20);
    let read = |reader: &mut RecordDeserializer, piece: &[u8]| {
        reader.set_next_buffer(one_buffer(&network, piece)).unwrap();
        let mut lens = Vec::new();
        while let Some(record) = reader.next_record().unwrap() {
            lens.push(record.len());
        }
        lens
    };
    let mut lens = Vec::new();
    for piece in framed.chunks(4000) {
        lens.extend(read(&mut reader, piece));
    }
    assert_eq!(lens, [1 << 20]);
    assert!(reader.held_bytes() >= 1 << 20);
    for _ in 0..64 {
        assert_eq!(read(&mut reader, &[3, b'a', b'b', b'c']), [3]);
    }
    assert!(
        reader.held_bytes() <= 64 * 1024,
        "{} held",
        reader.held_bytes()
    );
    // And on a release, after a large record begun and never finished.
    for piece in framed[..300_000].chunks(4000) {
        assert!(read(&mut reader, piece).is_empty());
    }
    assert!(reader.held_bytes() > 64 * 1024);
    reader.clear();
    assert!(
        reader.held_bytes() <= 64 * 1024,
        "{} held",
        reader.held_bytes()
    );
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn records_spanning_buffers_share_their_reader_s_memory_budget() {
    // Two channels each assembling a record of 700 000 bytes under a budget of 1 MiB: the
    // second's growth past it fails its read (each could hold up to the maximum record size
    // for a peer that claims it); once the first channel gives its memory back, the second
    // goes on where it stopped, and nothing stays charged.
    let (network, _) = network();
    let budget = SpanningBudget::new(1 << 20);
    let record_len = 700_000usize;
    let mut framed = vec![0xE0, 0xDC, 0x2A]; // 700 000 as LEB128
    framed.extend((0..record_len).map(|i| i as u8));
    let pieces: Vec<&[u8]> = framed.chunks(4000).collect();
    let begun = &pieces[..pieces.len() - 1];
    let mut first = RecordDeserializer::new(1 << 20).with_budget(budget.clone());
    let mut second = RecordDeserializer::new(1 << 20).with_budget(budget.clone());
    for piece in begun {
        first.set_next_buffer(one_buffer(&network, piece)).unwrap();
        assert_eq!(first.next_record().unwrap(), None);
    }
    assert!(budget.used() > 600_000, "{} charged", budget.used());
    let mut refused_at = None;
    for (at, piece) in pieces.iter().enumerate() {
        second.set_next_buffer(one_buffer(&network, piece)).unwrap();
        match second.next_record() {
            Ok(record) => assert_eq!(record.map(<[u8]>::len), None),
            Err(RecordError::SpanningMemory { limit, .. }) => {
                assert_eq!(limit, 1 << 20);
                refused_at = Some(at);
                break;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    let refused_at = refused_at.expect("the second record was refused memory");
    assert!(budget.used() <= 1 << 20, "{} charged", budget.used());
    first.clear();
    // The refused piece is still the second's buffer: read on from it.
    let mut lens = Vec::new();
    while let Some(record) = second.next_record().unwrap() {
        lens.push(record.len());
    }
    for piece in &pieces[refused_at + 1..] {
        second.set_next_buffer(one_buffer(&network, piece)).unwrap();
        while let Some(record) = second.next_record().unwrap() {
            assert!(record == &framed[3..], "the record's bytes differ");
            lens.push(record.len());
        }
    }
    assert_eq!(lens, [record_len]);
    drop((first, second));
    assert_eq!(budget.used(), 0);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn lengths_take_one_byte_under_128_and_two_under_16_kib() {
    // LEB128 written out by hand: seven bits a byte, least significant first, the top bit
    // saying "more follows".
    let cases: [(usize, &[u8]); 6] = [
        (0, &[0x00]),
        (127, &[0x7F]),
        (128, &[0x80, 0x01]),
        (16_383, &[0xFF, 0x7F]),
        (16_384, &[0x80, 0x80, 0x01]),
        (u32::MAX as usize, &[0xFF, 0xFF, 0xFF, 0xFF, 0x0F]),
    ];
    for (len, bytes) in cases {
        assert_eq!(record::prefix_len(len), bytes.len(), "{len}");
        let mut out = [0u8; record::MAX_LENGTH_PREFIX];
        let used = record::encode_prefix(len as u32, &mut out);
        assert_eq!(&out[..used], bytes, "{len}");
        assert_eq!(
            record::decode_prefix(bytes),
            record::Prefix::Complete {
                len,
                size: bytes.len()
            }
        );
        if bytes.len() > 1 {
            assert_eq!(
                record::decode_prefix(&bytes[..bytes.len() - 1]),
                record::Prefix::Incomplete
            );
        }
    }
}

#[test]
fn a_stream_ending_inside_a_record_is_truncated() {
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(64);
    let mut bytes = vec![10u8];
    bytes.extend_from_slice(b"abc");
    reader
        .set_next_buffer(one_buffer(&network, &bytes))
        .unwrap();
    assert_eq!(reader.next_record().unwrap(), None);
    assert_eq!(reader.finish().unwrap_err(), RecordError::Truncated);
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_new_buffer_before_the_old_one_is_read_is_refused() {
    let (network, _) = network();
    let mut reader = RecordDeserializer::new(64);
    reader
        .set_next_buffer(one_buffer(&network, b"\x01x"))
        .unwrap();
    assert_eq!(
        reader
            .set_next_buffer(one_buffer(&network, b""))
            .unwrap_err(),
        RecordError::BufferNotConsumed
    );
    drop(reader);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn oversized_records_are_refused_by_the_writer() {
    let (network, _) = network();
    let pool = network
        .create_local_pool(LocalPoolSpec::for_partition(1, &NetworkConfig::default()))
        .unwrap();
    let mut sink = QueueSink::new(&pool);
    let err = record::serialize(&[0u8; 65][..], &mut sink, 64).unwrap_err();
    assert_eq!(err, RecordError::TooLarge { len: 65, max: 64 });
    assert!(sink.current.is_none(), "nothing was written");
    drop(sink);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A user type that writes itself in two pieces straight into the segment.
struct Pair(u32, &'static str);

impl record::Record for Pair {
    fn encoded_len(&self) -> usize {
        4 + self.1.len()
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(&self.0.to_be_bytes())?;
        out.write(self.1.as_bytes())
    }
}

/// A broken user type: says 10 bytes, writes 3.
struct Liar;

impl record::Record for Liar {
    fn encoded_len(&self) -> usize {
        10
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(b"abc")
    }
}

#[test]
fn user_types_write_directly_and_a_wrong_length_keeps_the_stream_framed() {
    let (network, config) = network();
    let pool = network
        .create_local_pool(LocalPoolSpec::for_partition(1, &config))
        .unwrap();
    let mut sink = QueueSink::new(&pool);
    record::serialize(&Pair(7, "seven"), &mut sink, 64).unwrap();
    assert_eq!(
        record::serialize(&Liar, &mut sink, 64).unwrap_err(),
        RecordError::LengthMismatch {
            declared: 10,
            written: 3
        }
    );
    record::serialize("after", &mut sink, 64).unwrap();
    sink.finish();
    let mut reader = RecordDeserializer::new(64);
    let mut got = Vec::new();
    drain(&mut sink, &mut reader, &mut got, 0);
    assert_eq!(got[0], b"\0\0\0\x07seven");
    assert_eq!(got[1], b"abc\0\0\0\0\0\0\0");
    assert_eq!(got[2], b"after");
    drop((reader, sink));
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A broken user type: says 10 bytes, writes 3 and then 8.
struct Braggart;

impl record::Record for Braggart {
    fn encoded_len(&self) -> usize {
        10
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(b"abc")?;
        out.write(b"defghijk")
    }
}

#[test]
fn a_record_writing_more_than_it_declared_is_refused_with_its_own_counts() {
    // The error gave the bytes left to write (7) as declared and the refused write's (8) as
    // written, not the record's 10 and 11.
    let (network, config) = network();
    let pool = network
        .create_local_pool(LocalPoolSpec::for_partition(1, &config))
        .unwrap();
    let mut sink = QueueSink::new(&pool);
    assert_eq!(
        record::serialize(&Braggart, &mut sink, 64).unwrap_err(),
        RecordError::LengthMismatch {
            declared: 10,
            written: 11
        }
    );
    drop(sink);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A sink whose `writable` fails once, on its `fail_at`-th call (counting from 1), after
/// publishing the full builder as a sink waiting in vain for its next segment would: what a
/// pool timing out looks like to the record layer. It can neither take bytes back nor end its
/// stream, so the records after a failed one stay readable only if that one is framed whole.
struct FlakySink<'a> {
    inner: QueueSink<'a>,
    calls: usize,
    fail_at: usize,
}

impl SegmentSink for FlakySink<'_> {
    fn writable(&mut self) -> Result<&mut BufferBuilder, RecordError> {
        self.calls += 1;
        if self.calls == self.fail_at {
            if self
                .inner
                .current
                .as_ref()
                .is_some_and(|(b, _)| b.is_full())
            {
                self.inner.finish();
            }
            return Err(RecordError::Pool(fluxgate::buffer::PoolError::Timeout(
                std::time::Duration::from_millis(1),
            )));
        }
        self.inner.writable()
    }

    fn commit(&mut self) {
        self.inner.commit();
    }
}

/// Serializes `first`, then `failing` through a sink that fails on `fail_at`, then "after";
/// returns what `failing`'s serialize said and what a reader took from the stream.
fn around_a_failing_sink(
    first: &[u8],
    failing: &[u8],
    fail_at: usize,
) -> (Result<(), RecordError>, Vec<Vec<u8>>) {
    let (network, config) = network();
    let pool = network
        .create_local_pool(LocalPoolSpec::for_partition(1, &config))
        .unwrap();
    let mut sink = FlakySink {
        inner: QueueSink::new(&pool),
        calls: 0,
        fail_at: usize::MAX,
    };
    record::serialize(first, &mut sink, 1 << 20).unwrap();
    sink.calls = 0;
    sink.fail_at = fail_at;
    let failed = record::serialize(failing, &mut sink, 1 << 20);
    record::serialize("after", &mut sink, 1 << 20).unwrap();
    sink.inner.finish();
    let mut reader = RecordDeserializer::new(1 << 20);
    let mut got = Vec::new();
    drain(&mut sink.inner, &mut reader, &mut got, 0);
    reader.finish().expect("the stream ends on a record's end");
    drop((reader, sink));
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
    (failed, got)
}

/// A sink failing to give the next segment in the middle of a record's bytes: the record was
/// counted as written in full before its bytes were in a segment, so it was padded too little
/// (here not at all), and "after" was read as the failed record's missing bytes.
#[test]
fn a_sink_failing_inside_a_record_leaves_the_stream_framed() {
    // 4093 of the 5000 bytes fill the first segment (after the empty record's 1-byte prefix
    // and the 2-byte prefix); the sink fails to give the second (its third call: the prefix,
    // the first segment's part, the next segment).
    let (failed, got) = around_a_failing_sink(b"", &[7; 5000], 3);
    assert!(matches!(failed, Err(RecordError::Pool(_))), "{failed:?}");
    assert_eq!(
        got.len(),
        3,
        "{:?}",
        got.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert_eq!(got[0], b"");
    // The failed record, framed whole: what it wrote, padded (the sink can take nothing
    // back, and the part in the first segment went out).
    assert_eq!(got[1].len(), 5000);
    assert!(got[1][..4093].iter().all(|&b| b == 7));
    assert!(got[1][4093..].iter().all(|&b| b == 0));
    assert_eq!(got[2], b"after");
}

/// The same between the two bytes of a length prefix: the prefix's failure returned before
/// the record was framed, leaving half a prefix in the stream for "after" to complete.
#[test]
fn a_sink_failing_inside_a_length_prefix_leaves_the_stream_framed() {
    // 2 + 4093 bytes leave one byte of the segment free: the 200-byte record's 2-byte prefix
    // is split, and the sink fails to give the segment for its second byte.
    let (failed, got) = around_a_failing_sink(&[1; 4093], &[2; 200], 2);
    assert!(matches!(failed, Err(RecordError::Pool(_))), "{failed:?}");
    assert_eq!(
        got.len(),
        3,
        "{:?}",
        got.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert_eq!(got[0], [1; 4093]);
    assert_eq!(got[1], [0; 200], "the failed record, framed and padded");
    assert_eq!(got[2], b"after");
}
