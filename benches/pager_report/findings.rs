//! The report's findings: what is slow and why, with the run's own figures (medians unless a
//! range is given).

use std::fmt::Write as _;

use crate::common::results::{sig3, Results, Summary};
use crate::resume;
use crate::Settings;

fn med(results: &Results, key: &str) -> f64 {
    results.summary(key).median
}

pub fn write(out: &mut String, results: &Results, settings: &Settings) {
    out.push_str("## Findings\n\n");
    compressed_faults(out, results);
    prefetcher(out, results, settings);
    working_set(out, results, settings);
    restore(out, results);
    delivery(out, results);
    prefetch_panic(out, results, settings);
}

fn prefetch_panic(out: &mut String, results: &Results, settings: &Settings) {
    let (mut hit, mut total) = (0, 0);
    for head in [0, settings.head_start_ms] {
        for r in 1..=crate::resume::RESUMES {
            for &v in results.values(&format!(
                "{}.prefetch_unfinished_pages",
                resume::key(head, r)
            )) {
                if !v.is_nan() {
                    total += 1;
                    hit += usize::from(v > 0.0);
                }
            }
        }
    }
    let _ = writeln!(
        out,
        "6. **The prefetcher no longer dies on a race with the fault threads.** `fill_block` used to \
         extend a run of stored pages with a second read of their states, and a fault thread could \
         empty the run between the two, which panicked the prefetch thread; it now skips such a run. \
         The bench checks every lazy load for stored pages left after `wait_prefetch`: {hit} of this \
         run's {total} loads.\n"
    );
}

fn compressed_faults(out: &mut String, results: &Results) {
    let raw_fault = med(results, "latency.raw.t1.c1.pager_p50_us");
    let lz4_fault = med(results, "latency.lz4.t1.c1.pager_p50_us");
    let touch_ratio = med(results, "ratio.latency.lz4_over_raw.touch_p50_us");
    let raw_read = med(results, "latency.raw.read_p50_us");
    let lz4_read = med(results, "latency.lz4.read_p50_us");
    let fetch = med(results, "latency.lz4.fetch_p50_us");
    let decode = med(results, "latency.lz4.decode_p50_us");
    let zstd_decode = med(results, "latency.zstd.decode_p50_us");
    let gbps = |us: f64| 65_536.0 / (us * 1e-6) / 1e9;
    // What the decode may cost for the lz4 fault to be 1.3× the raw one, by the pager's own
    // times: the raw fault's read plus 30% of the raw fault, less the store's fetch.
    let budget = raw_read + 0.3 * raw_fault - fetch;
    let _ = writeln!(
        out,
        "1. **An lz4 fault costs {}× a raw-file fault ({}× by the pager's histogram) because the whole \
         64 KiB block is decoded before anything is installed.** By the pager's histogram a raw-file \
         fault takes {} µs, of which {} µs \
         is the `pread` of the block; the rest ({} µs) is one `UFFDIO_COPY` of 16 pages, the state \
         table and the wake. An lz4 fault takes {} µs: about the same {} µs of install and wake, plus \
         {} µs to read the block from the store — {} µs to fetch its {} KiB payload and check its \
         xxh3, and **{} µs to decode it** ({} GB/s). The decode alone is {}× a whole raw-file fault. \
         For an lz4 fault to cost 1.3× a raw one (by these times) the decode would have to take \
         about {} µs (≥ {} GB/s), {}× faster than lz4 runs here on this content. The path is \
         `Shared::resolve` \
         (`pager.rs`) → `StoreSource::read` (`source.rs`) → `DiskStore::get` → `Decoder::decode` into \
         the fault thread's 64 KiB buffer → one `UFFDIO_COPY`; nothing else in it is slow (fetch and \
         checksum {} µs, against {} µs for the raw `pread`). What would meet the target is decoding \
         less before the install — an LZ4 block decodes front to back, so a fault on page *k* needs \
         only pages 0..=*k* decoded (the rest can follow, or go to the prefetcher), or smaller blocks \
         for compressed stores — or decoding ahead of the faults on the other core. zstd:3 decodes at \
         {} GB/s here ({} µs a block).\n",
        sig3(touch_ratio),
        sig3(lz4_fault / raw_fault),
        sig3(raw_fault),
        sig3(raw_read),
        sig3(raw_fault - raw_read),
        sig3(lz4_fault),
        sig3(lz4_fault - lz4_read),
        sig3(lz4_read),
        sig3(fetch),
        sig3(med(results, "latency.lz4.payload_kib")),
        sig3(decode),
        sig3(gbps(decode)),
        sig3(decode / raw_fault),
        sig3(budget.max(0.0)),
        sig3(gbps(budget.max(0.1))),
        sig3(decode / budget.max(0.1)),
        sig3(fetch),
        sig3(raw_read),
        sig3(gbps(zstd_decode)),
        sig3(zstd_decode),
    );
}

fn prefetcher(out: &mut String, results: &Results, settings: &Settings) {
    let h = settings.head_start_ms;
    let k0 = |r| resume::key(0, r);
    let kh = |r| resume::key(h, r);
    let m = |key: String| med(results, &key);
    // Stalls of the touching thread that the pager never saw (woken by the prefetcher's wake).
    let unseen = m(format!("{}.thread_faults", k0(2)))
        - m(format!("{}.sync_faults", k0(2)))
        - m(format!("{}.raced", k0(2)));
    let _ = writeln!(
        out,
        "2. **The recorded working set saves what the prefetcher installs before the vCPU gets to \
         it, and little after.** A lazy load installs the recorded set first, with two threads, then \
         the rest in image order, skipping ahead of the latest fault (so that it does not race the \
         faulting thread for the block it is blocked on) and yielding while faults are pending. First \
         → second resume, the touching thread stalled {} → {} times with no head start ({}×) and \
         {} → {} with {h} ms ({}×), and took {} → {} ms and {} → {} ms to touch the set; the pager's \
         `faults_copy + faults_zero` went {} → {} with no head start. With the {h} ms head start the \
         prefetcher installed {} MiB of the set before the first access (the first resume's, in image \
         order: {} MiB). Once the vCPU reads, it outruns the prefetcher: one byte per page reaches the \
         next block in microseconds, while installing a block costs tens (the lz4 decode of finding 1, \
         the copy, and on this VM fresh pages from the host); in the second resume with no head start \
         {} of the touching thread's {} stalls were resolved by the prefetcher while it waited ({} MiB \
         of blocks; it installed {} MiB during the touch) and {} more found their block installed when \
         a fault thread got to them (`eexist_races`). Halving the vCPU's stalls for a 64 MiB set needs \
         about half of it installed before the first access.\n",
        sig3(m(format!("{}.thread_faults", k0(1)))),
        sig3(m(format!("{}.thread_faults", k0(2)))),
        sig3(m("ratio.resume.h0.first_over_r2.thread_faults".into())),
        sig3(m(format!("{}.thread_faults", kh(1)))),
        sig3(m(format!("{}.thread_faults", kh(2)))),
        sig3(m(format!("ratio.resume.h{h}.first_over_r2.thread_faults"))),
        sig3(m(format!("{}.touch_ms", k0(1)))),
        sig3(m(format!("{}.touch_ms", k0(2)))),
        sig3(m(format!("{}.touch_ms", kh(1)))),
        sig3(m(format!("{}.touch_ms", kh(2)))),
        sig3(m(format!("{}.sync_faults", k0(1)))),
        sig3(m(format!("{}.sync_faults", k0(2)))),
        sig3(m(format!("{}.prefetched_before_mib", kh(2)))),
        sig3(m(format!("{}.prefetched_before_mib", kh(1)))),
        sig3(unseen),
        sig3(m(format!("{}.thread_faults", k0(2)))),
        sig3(unseen / 16.0),
        sig3(m(format!("{}.prefetched_during_mib", k0(2)))),
        sig3(m(format!("{}.raced", k0(2)))),
    );
}

fn working_set(out: &mut String, results: &Results, settings: &Settings) {
    let h = settings.head_start_ms;
    let kh = |r| resume::key(h, r);
    let _ = writeln!(
        out,
        "3. **The recorded working set is kept from one resume to the next.** A load starts the \
         new record from the saved set, so blocks the prefetcher installed (which raise no fault) \
         stay in it, and the faults of the resume are added after them. With {h} ms of head start \
         the first resume recorded {} blocks of the {} MiB set; the second faulted {} times and \
         saved {} blocks for the third, which faulted {} times (first {}, second {}; with no head \
         start: {} → {} → {}).\n",
        sig3(med(results, &format!("{}.ws_blocks", kh(2)))),
        settings.lazy_total >> 20,
        sig3(med(results, &format!("{}.sync_faults", kh(2)))),
        sig3(med(results, &format!("{}.ws_blocks", kh(3)))),
        sig3(med(results, &format!("{}.sync_faults", kh(3)))),
        sig3(med(results, &format!("{}.sync_faults", kh(1)))),
        sig3(med(results, &format!("{}.sync_faults", kh(2)))),
        sig3(med(results, &format!("{}.sync_faults", resume::key(0, 1)))),
        sig3(med(results, &format!("{}.sync_faults", resume::key(0, 2)))),
        sig3(med(results, &format!("{}.sync_faults", resume::key(0, 3)))),
    );
}

/// Median of `key` over the runs where the Firecracker-style full restore ran with other
/// processes using less (`busy` false) or at least (`busy` true) half a CPU.
fn median_where(results: &Results, key: &str, busy: bool) -> Option<f64> {
    let other = results.values("restore.full.firecracker.other_cpu_pct");
    let picked = results.values(key).iter().zip(other);
    let picked = picked.filter(|(_, o)| !o.is_nan() && (**o >= 50.0) == busy);
    Some(Summary::of(picked.map(|(v, _)| *v))?.median)
}

fn regimes(out: &mut String, results: &Results) {
    let mut parts = Vec::new();
    for (busy, name) in [
        (false, "nearly idle (other processes < 50% of a CPU)"),
        (true, "busy (≥ 50%)"),
    ] {
        let (Some(fc), Some(raw), Some(lz4)) = (
            median_where(results, "restore.full.firecracker.ms", busy),
            median_where(
                results,
                "ratio.restore.full.firecracker_over_ours_raw",
                busy,
            ),
            median_where(
                results,
                "ratio.restore.full.firecracker_over_ours_lz4",
                busy,
            ),
        ) else {
            continue;
        };
        let runs = results
            .values("restore.full.firecracker.other_cpu_pct")
            .iter()
            .filter(|o| !o.is_nan() && (**o >= 50.0) == busy)
            .count();
        parts.push(format!(
            "in the {runs} run(s) where the machine was {name}, a Firecracker-style fault took {} µs and \
             the ratios were {}× (raw) and {}× (lz4)",
            sig3(fc * 1e3 / 131_072.0),
            sig3(raw),
            sig3(lz4)
        ));
    }
    if !parts.is_empty() {
        let _ = write!(out, " By the load on the machine: {}.", parts.join("; "));
    }
}

fn restore(out: &mut String, results: &Results) {
    let per_fault = |who: &str| {
        med(results, &format!("restore.full.{who}.ms")) * 1e3
            / med(results, &format!("restore.full.{who}.faults"))
    };
    let _ = write!(
        out,
        "4. **Restore: fewer, larger faults.** A full restore through our server takes {} faults where \
         the Firecracker-style handler takes {} (one per 4 KiB page). Each of ours costs about {} µs \
         from the raw file and {} µs from the lz4 store (median time / faults) against {} µs for a \
         Firecracker-style 4 KiB fault, hence {}× (raw) and {}× (lz4) over the whole restore. From the \
         lz4 store every fault also pays the decode of finding 1, which is why its margin is smaller \
         (min {}×). The ratio depends on how busy the machine is, because every fault is two \
         hand-offs between threads (the fault to the handler, the wake back), and on this VM a vCPU \
         with nothing to run halts (halt polling is off) and must be woken through the host: when \
         other processes keep both vCPUs busy, hand-offs are cheap and the Firecracker-style \
         handler's 16× more faults cost less.",
        sig3(med(results, "restore.full.ours_raw.faults")),
        sig3(med(results, "restore.full.firecracker.faults")),
        sig3(per_fault("ours_raw")),
        sig3(per_fault("ours_lz4")),
        sig3(per_fault("firecracker")),
        sig3(med(results, "ratio.restore.full.firecracker_over_ours_raw")),
        sig3(med(results, "ratio.restore.full.firecracker_over_ours_lz4")),
        sig3(results.summary("ratio.restore.full.firecracker_over_ours_lz4").min),
    );
    regimes(out, results);
    out.push_str("\n\n");
}

fn delivery(out: &mut String, results: &Results) {
    let _ = writeln!(
        out,
        "5. **The touching thread sees the pager's time plus the fault's delivery.** For a raw-file \
         fault the touching thread measures {} µs at p50 where the pager's histogram says {} µs; the \
         difference is the kernel handing the fault to the fault thread (a `poll` wake-up) and waking \
         the faulting thread after `UFFDIO_WAKE`, which on this VM can mean waking a halted vCPU. It \
         grows with the other work on the machine and shows most at p99 ({} µs against {} µs by the \
         histogram). With 4 touching threads and one fault thread, faults queue: lz4 p50 {} µs at the \
         touching threads, {} µs with 2 fault threads, whose busiest took {} of their CPU time (the \
         work is shared). One caveat on the histogram: `Shared::serve` stops its clock after \
         `resolve` returns, when the faulting thread is already awake, so if that thread preempts the \
         fault thread on its CPU the wait until the fault thread runs again is counted too (it can \
         put a pager p50 above the touching thread's).\n",
        sig3(med(results, "latency.raw.t1.c1.touch_p50_us")),
        sig3(med(results, "latency.raw.t1.c1.pager_p50_us")),
        sig3(med(results, "latency.raw.t1.c1.touch_p99_us")),
        sig3(med(results, "latency.raw.t1.c1.pager_p99_us")),
        sig3(med(results, "latency.lz4.t1.c4.touch_p50_us")),
        sig3(med(results, "latency.lz4.t2.c4.touch_p50_us")),
        sig3(med(results, "latency.lz4.t2.c4.busiest_fault_thread_share")),
    );
}
