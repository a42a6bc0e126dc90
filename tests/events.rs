//! Events: every event survives encode → decode; any other bytes are a typed error.

use fluxgate::buffer::DataType;
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event, EventError, StopMode};
use proptest::prelude::*;

fn event() -> impl Strategy<Value = Event> {
    let alignment = prop_oneof![
        Just(Alignment::Aligned),
        Just(Alignment::Unaligned),
        any::<u64>().prop_map(|timeout_ms| Alignment::AlignedWithTimeout { timeout_ms }),
        Just(Alignment::ForcedAligned),
    ];
    let kind = prop_oneof![
        Just(CheckpointKind::Checkpoint),
        Just(CheckpointKind::Savepoint)
    ];
    prop_oneof![
        Just(Event::EndOfPartition),
        (any::<u64>(), any::<i64>(), kind, alignment)
            .prop_map(|(id, timestamp, kind, alignment)| CheckpointBarrier {
                id,
                timestamp,
                kind,
                alignment,
            })
            // Flink never makes an unaligned savepoint: see the test below.
            .prop_filter("a barrier Flink makes", |b| b.validate().is_ok())
            .prop_map(Event::CheckpointBarrier),
        any::<u64>().prop_map(Event::CancelCheckpointMarker),
        prop_oneof![Just(StopMode::Drain), Just(StopMode::NoDrain)].prop_map(Event::EndOfData),
        Just(Event::EndOfChannelState),
        prop::collection::vec(any::<u8>(), 0..100).prop_map(Event::Task),
    ]
}

proptest! {
    #[test]
    fn events_round_trip(event in event()) {
        let mut bytes = Vec::new();
        event.encode(&mut bytes);
        prop_assert_eq!(bytes.len(), event.encoded_len());
        prop_assert_eq!(Event::decode(&bytes).unwrap(), event.clone());
        // Every strict prefix is truncated input, never a different event.
        for cut in 0..bytes.len() {
            prop_assert!(Event::decode(&bytes[..cut]).is_err());
        }
        bytes.push(0);
        prop_assert_eq!(Event::decode(&bytes).unwrap_err(), EventError::Trailing(1));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = Event::decode(&bytes);
    }
}

#[test]
fn malformed_events_name_what_is_wrong() {
    assert_eq!(Event::decode(&[]).unwrap_err(), EventError::Empty);
    assert_eq!(
        Event::decode(&[99]).unwrap_err(),
        EventError::UnknownTag(99)
    );
    assert_eq!(
        Event::decode(&[3, 7]).unwrap_err(),
        EventError::InvalidField {
            field: "stop mode",
            value: 7
        }
    );
    assert_eq!(
        Event::decode(&[5, 0xff, 0xff, 0xff, 0xff]).unwrap_err(),
        EventError::Truncated("task")
    );
}

#[test]
fn data_types_follow_flink() {
    let barrier = |alignment| {
        Event::CheckpointBarrier(CheckpointBarrier {
            id: 1,
            timestamp: 0,
            kind: CheckpointKind::Checkpoint,
            alignment,
        })
    };
    assert_eq!(
        barrier(Alignment::Aligned).data_type(false),
        DataType::AlignedCheckpointBarrier
    );
    assert_eq!(
        barrier(Alignment::AlignedWithTimeout { timeout_ms: 5 }).data_type(false),
        DataType::TimeoutableAlignedCheckpointBarrier
    );
    assert_eq!(
        barrier(Alignment::Unaligned).data_type(true),
        DataType::PrioritizedEventBuffer
    );
    assert_eq!(
        barrier(Alignment::Unaligned).data_type(false),
        DataType::EventBuffer
    );
    assert_eq!(
        Event::EndOfPartition.data_type(false),
        DataType::EventBuffer
    );
    assert_eq!(
        Event::EndOfChannelState.data_type(false),
        DataType::RecoveryCompletion
    );
    for ordinal in 0..=255u8 {
        if let Some(t) = DataType::from_ordinal(ordinal) {
            assert_eq!(t as u8, ordinal);
            assert!(!(t.has_priority() && t.requires_announcement()));
        }
    }
}

#[test]
fn an_unaligned_savepoint_barrier_is_refused() {
    let barrier = CheckpointBarrier {
        id: 1,
        timestamp: 0,
        kind: CheckpointKind::Savepoint,
        alignment: Alignment::Unaligned,
    };
    let refused = EventError::InvalidField {
        field: "alignment of a savepoint barrier",
        value: 1,
    };
    assert_eq!(barrier.validate(), Err(refused.clone()));
    let mut bytes = Vec::new();
    Event::CheckpointBarrier(barrier).encode(&mut bytes);
    assert_eq!(Event::decode(&bytes).unwrap_err(), refused);
}
