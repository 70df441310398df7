//! The allocator-snapshot reader against pickles of the snapshot's shape, written by
//! Python's pickle at protocols 2 (what torch's JIT pickler writes) and 4.
use headroom_trainer::pickle::{parse, Value};
use headroom_trainer::snapshot::segment_map;

fn fixture(proto: u32) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/snapshot_p{proto}.pickle",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(path).unwrap()
}

#[test]
fn segments_and_blocks_come_out_in_address_order_per_device() {
    for proto in [2, 4] {
        let map = segment_map(&fixture(proto), 0).unwrap();
        assert_eq!(map.segments.len(), 2, "device 1's segment excluded");
        let small = &map.segments[0];
        assert_eq!(small.pool, "small");
        assert_eq!(small.allocated_bytes(), 1024, "two 512 B blocks merged");
        assert_eq!(small.runs.len(), 2);
        let large = &map.segments[1];
        assert_eq!(large.total_size, 20 << 20);
        let runs: Vec<(u64, bool)> = large
            .runs
            .iter()
            .map(|r| (r.size >> 20, r.allocated))
            .collect();
        // pending-free blocks still hold memory: they count as allocated.
        assert_eq!(runs, vec![(8, true), (2, false), (6, true), (4, false)]);
        assert_eq!(map.reserved(), (20 << 20) + (2 << 20));
        let other = segment_map(&fixture(proto), 1).unwrap();
        assert_eq!(other.segments.len(), 1);
    }
}

#[test]
fn values_of_every_kind_decode() {
    let root = parse(&fixture(2)).unwrap();
    assert_eq!(root.get("ratio"), Some(&Value::Float(0.25)));
    let settings = root.get("allocator_settings").unwrap();
    assert_eq!(settings.get("max_split_size"), Some(&Value::Int(-1)));
    assert_eq!(
        settings.get("expandable_segments"),
        Some(&Value::Bool(false))
    );
    // GLOBAL + REDUCE (torch's build_intlist shape) yields the wrapped list.
    let sizes: Vec<i64> = settings
        .get("pinned_sizes")
        .and_then(Value::as_list)
        .unwrap()
        .iter()
        .map(|v| match v {
            Value::Int(i) => *i,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(sizes, vec![1, 2, 300000, -5, 1 << 40]);
}

#[test]
fn damaged_pickles_are_errors_not_panics() {
    let bytes = fixture(2);
    for cut in [0, 1, 2, 10, bytes.len() / 2, bytes.len() - 1] {
        assert!(segment_map(&bytes[..cut], 0).is_err(), "cut at {cut}");
    }
    assert!(parse(b"\x80\x02\xff.")
        .unwrap_err()
        .contains("unsupported opcode"));
    assert!(segment_map(b"\x80\x02}q\x00.", 0)
        .unwrap_err()
        .contains("segments"));
}
