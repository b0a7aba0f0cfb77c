//! The targets of the issue, judged on the results: a speed or cost target passes when the
//! median of its per-run ratios meets it; the disk-size target is judged on the largest run.

use compressed_backing::Codec;

use crate::common::{Content, IMAGE};
use crate::plan::{
    self, Goal, MemOp, Op, StoreCase, DECODE_SPEED, LZ4, LZ4_CASES, MEMORY_CONTENTS,
    REPEATED_DISK_PER_64MIB, WRITE_COST, ZSTD1, ZSTD3, ZSTD9,
};
use crate::report::bytes;
use crate::results::Results;

pub use crate::common::verdict::Verdict;

/// `PASS` or `FAIL`.
fn pass(ok: bool) -> &'static str {
    crate::common::verdict::result(true, ok, crate::common::verdict::PASS_FAIL)
}

/// `0.17× WHAT (median of 7; min 0.16, max 0.22; 0 of 7 runs meet it)` for the ratio `key`,
/// and whether its median meets `goal`.
fn ratio_figure(results: &Results, key: &str, what: &str, goal: Goal) -> (String, bool) {
    let s = results.summary(key);
    let runs = results.runs;
    let meeting = results.count(key, |v| goal.met(v));
    let text = format!(
        "{:.2}× {what} (median of {runs}; min {:.2}, max {:.2}; {meeting} of {runs} runs meet it)",
        s.median, s.min, s.max
    );
    (text, goal.met(s.median))
}

pub fn verdicts(results: &Results, image: usize) -> Vec<Verdict> {
    let mut verdicts = Vec::new();
    for content in MEMORY_CONTENTS {
        let c = content.name();
        let key = |memcpy| plan::decode_ratio_key(LZ4, memcpy, content);
        let (blocks, ok) = ratio_figure(
            results,
            &key(MemOp::MemcpyBlocks),
            "the speed of memcpy block by block",
            DECODE_SPEED,
        );
        let (whole, _) = ratio_figure(
            results,
            &key(MemOp::MemcpyWhole),
            "the speed of memcpy of the whole buffer",
            DECODE_SPEED,
        );
        verdicts.push(Verdict {
            target: format!("lz4 block decompress ≥ 25% of memcpy speed ({c} content)"),
            figure: format!("judged: {blocks}; beside it, not judged: {whole}"),
            result: pass(ok),
        });
    }
    for case in LZ4_CASES {
        let key = Op::Write.cost_key(case, Content::Random);
        let what = "the raw pwrite+fsync time";
        let (figure, ok) = ratio_figure(results, &key, what, WRITE_COST);
        verdicts.push(Verdict {
            target: format!(
                "random (incompressible) 64 MiB costs ≤ 1.3× a raw write ({})",
                case.label()
            ),
            figure,
            result: pass(ok),
        });
    }
    let limit = REPEATED_DISK_PER_64MIB * image as f64 / IMAGE as f64;
    for codec in [LZ4, ZSTD3] {
        let store = plan::store_key(StoreCase::new(codec, 2), Content::Repeated);
        let disk = results.summary(&plan::key(&["size.disk", &store])).max;
        let all = results.summary(&plan::key(&["size.all_files", &store])).max;
        let worst = disk.max(all);
        verdicts.push(Verdict {
            target: format!("repeated-pattern 64 MiB stores in ≤ 1 MiB on disk ({codec})"),
            figure: format!(
                "{} allocated (StoreStats::disk_bytes {}, all files of the store {}; largest \
                 of {} runs)",
                bytes(worst),
                bytes(disk),
                bytes(all),
                results.runs
            ),
            result: pass(worst <= limit),
        });
    }
    let ratio = |what: &str, codec: Codec| {
        let store = plan::store_key(StoreCase::new(codec, 2), Content::Realistic);
        let key = plan::key(&[&format!("ratio.raw_per_{what}"), &store]);
        results.summary(&key).median
    };
    verdicts.push(Verdict {
        target: "zstd ratio on the realistic sample stated".to_owned(),
        figure: format!(
            "zstd:3 {:.2}:1 raw/stored, {:.2}:1 raw/disk (zstd:1 {:.2}:1, zstd:9 {:.2}:1, lz4 \
             {:.2}:1 raw/stored)",
            ratio("stored", ZSTD3),
            ratio("disk", ZSTD3),
            ratio("stored", ZSTD1),
            ratio("stored", ZSTD9),
            ratio("stored", LZ4),
        ),
        result: "STATED",
    });
    verdicts
}
