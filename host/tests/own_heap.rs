//! The global allocator of headroom's processes under a full hard cap: every allocation
//! a run's bookkeeping makes (small records, a checkpoint-sized buffer, growing vectors,
//! zeroed and over-aligned blocks, from several threads) is served, and the cap still
//! refuses the system allocator, as it refuses libtorch's tensors.
//!
//! The cap is process-wide, so the capped half runs in a child process: this test
//! binary started again with `OWN_HEAP_CHILD` set.
use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;

use headroom_host::own_heap::{spare_usage, OwnHeap};

#[global_allocator]
static HEAP: OwnHeap = OwnHeap;

const CHILD: &str = "OWN_HEAP_CHILD";

fn vm_data() -> u64 {
    headroom_host::procmem::status_kib("VmData:").unwrap() * 1024
}

/// Fills the cap: from here on the kernel gives no new private memory.
///
/// libtest's main thread registers a thread-local destructor the first time it blocks for
/// the test's result (glibc mallocs for it), and on a busy machine that can come after the
/// test thread got here: under a full cap that malloc aborts the child ("failed to register
/// TLS destructor: out of memory", 1 run in 5 under load). It is given time to block first.
fn fill_cap() {
    std::thread::sleep(std::time::Duration::from_millis(300));
    let lim = libc::rlimit {
        rlim_cur: vm_data(),
        rlim_max: libc::RLIM_INFINITY,
    };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_DATA, &lim) }, 0);
}

fn child() {
    fill_cap();
    // The cap refuses a fresh mapping: what libtorch's large tensors meet.
    let refused = unsafe { System.alloc(Layout::from_size_align(64 << 20, 64).unwrap()) };
    assert!(
        refused.is_null(),
        "the cap must refuse the system allocator"
    );

    // A checkpoint-sized buffer, written end to end.
    let mut big = vec![7u8; 96 << 20];
    big[(96 << 20) - 1] = 9;
    assert_eq!(
        big.iter().map(|&b| b as u64).sum::<u64>(),
        7 * (96 << 20) + 2
    );
    // A vector grown by doubling, from nothing: realloc moves it between blocks.
    let mut grown: Vec<u64> = Vec::new();
    for i in 0..2_000_000u64 {
        grown.push(i);
    }
    assert_eq!(grown.iter().sum::<u64>(), 1_999_999 * 2_000_000 / 2);
    // Many small records, freed and made again (free lists reused).
    for round in 0..3 {
        let records: Vec<String> = (0..50_000)
            .map(|i| format!("{{\"kind\":\"sample\",\"round\":{round},\"i\":{i}}}"))
            .collect();
        assert!(records[49_999].contains("49999"));
    }
    // Zeroed and over-aligned blocks.
    let zeroed = vec![0u64; 300_000];
    assert!(zeroed.iter().all(|&z| z == 0));
    for align in [16usize, 256, 4096, 1 << 16] {
        let l = Layout::from_size_align(100, align).unwrap();
        let p = unsafe { std::alloc::alloc_zeroed(l) };
        assert!(
            !p.is_null() && (p as usize).is_multiple_of(align),
            "align {align}"
        );
        assert!((0..100).all(|i| unsafe { *p.add(i) } == 0));
        unsafe { std::alloc::dealloc(p, l) };
    }
    drop(big);
    drop(grown);
    let usage = spare_usage();
    assert!(usage.served > 0, "{usage:?}");
    println!(
        "served {} blocks, {} bytes live",
        usage.served, usage.live_bytes
    );
}

#[test]
fn a_full_cap_refuses_the_system_allocator_and_never_headrooms_own_allocations() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    let text =
        in_a_child("a_full_cap_refuses_the_system_allocator_and_never_headrooms_own_allocations");
    assert!(text.contains("served "), "{text}");
}

/// Runs one test of this binary again in a child process with [`CHILD`] set (the cap is
/// process-wide); returns what it printed, after asserting it passed.
fn in_a_child(test: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{:?}: {text}", out.status);
    text
}

/// Threads that allocate at once under a full cap: the spare pages' lock keeps their
/// blocks apart. The threads have started before the cap is filled (a thread's stack and
/// the signal stack Rust maps as it starts are private mappings, like the run's own
/// threads, which exist before it trains).
#[test]
fn threads_allocating_at_once_under_a_full_cap_keep_their_blocks_apart() {
    if std::env::var_os(CHILD).is_some() {
        let started = std::sync::Arc::new(std::sync::Barrier::new(5));
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(5));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (started, barrier) = (started.clone(), barrier.clone());
                std::thread::spawn(move || {
                    started.wait();
                    barrier.wait();
                    let mut kept = Vec::new();
                    for i in 0..20_000u64 {
                        kept.push(vec![t * 1_000_000 + i; (i % 64 + 1) as usize]);
                        if i % 3 == 0 {
                            kept.swap_remove((i as usize * 7) % kept.len());
                        }
                    }
                    kept.iter()
                        .all(|v| v.iter().all(|&x| x / 1_000_000 == t && x == v[0]))
                })
            })
            .collect();
        started.wait();
        fill_cap();
        barrier.wait();
        for t in threads {
            assert!(
                t.join().unwrap(),
                "a block was overwritten by another thread"
            );
        }
        assert!(spare_usage().served > 0);
        println!("ok");
        return;
    }
    in_a_child("threads_allocating_at_once_under_a_full_cap_keep_their_blocks_apart");
}

/// A run's threads started under a full cap (a second run in a process whose first one
/// trained to the cap): the kernel has no room for a thread's stack. The log writer and
/// the sampler that cannot start are each said once, and the run goes on without them;
/// before, the log writer's `expect` panicked.
#[test]
fn threads_a_full_cap_refuses_are_said_and_the_run_goes_on_without_them() {
    use headroom_core::Telemetry;
    use headroom_host::sampler::Sampler;
    use headroom_host::server::ServeOptions;
    use headroom_host::session::{run_bus, Sinks};

    if std::env::var_os(CHILD).is_some() {
        let dir = std::env::temp_dir().join(format!("own-heap-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.jsonl");
        let log = headroom_host::logger::open(&path, &[], None, std::time::Duration::from_secs(1))
            .unwrap();
        let (bus, rx) = run_bus(true);
        let (commands, _held) = crossbeam_channel::unbounded();
        let opts = ServeOptions {
            run_name: "capped".into(),
            listen: None,
            producer: "test".into(),
            job: None,
        };
        fill_cap();
        let sinks = Sinks::start(&bus, Some(log), rx.log, None, commands, opts)
            .with_sampler(Sampler::start(bus.clone(), None, 20.0, None));
        let said: Vec<String> = rx
            .events
            .try_iter()
            .filter_map(|r| match r.msg {
                Telemetry::Notice(n) => Some(format!("{}: {}", n.source, n.text)),
                _ => None,
            })
            .collect();
        assert!(
            said.iter()
                .any(|t| t.starts_with("log: the log writer's thread could not start")),
            "{said:?}"
        );
        assert!(
            said.iter()
                .any(|t| t.starts_with("sampler: the sampler's thread could not start")),
            "{said:?}"
        );
        assert_eq!(sinks.close(), None);
        let _ = std::fs::remove_dir_all(&dir);
        println!("said: {said:?}");
        return;
    }
    let text = in_a_child("threads_a_full_cap_refuses_are_said_and_the_run_goes_on_without_them");
    assert!(text.contains("said: "), "{text}");
}
