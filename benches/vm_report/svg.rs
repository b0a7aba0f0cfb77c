//! The chart: resume + task ratios, PSS after offload and backing (log scales, median dot,
//! min–max whiskers, target dashed, the seed's figure as a diamond), and where the eager
//! resume + task goes (stacked medians).

use std::fmt::Write as _;

use crate::common::svg::document;
use crate::results::{Results, Summary};
use crate::{Codec, Content, Settings};

const WIDTH: f64 = 980.0;
const LEFT: f64 = 400.0;
const RIGHT: f64 = 950.0;
const ROW: f64 = 18.0;

struct Row {
    label: String,
    summary: Option<Summary>,
    seed: Option<f64>,
}

struct Panel {
    title: String,
    rows: Vec<Row>,
    target: Option<(f64, String)>,
}

/// The seed's figures (pvisor, N=1), by content: resume + task ratio raw, compressed; PSS
/// after offload raw, compressed; backing raw, compressed.
pub fn seed(content: Content) -> [f64; 6] {
    match content {
        Content::Repeated => [432.4 / 276.5, 1730.3 / 276.5, 35.6, 39.8, 186.4, 15.5],
        Content::Random => [498.2 / 320.1, 766.2 / 320.1, 35.8, 39.5, 186.3, 146.0],
    }
}

fn nice_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi * 1.0001 {
        for m in [1.0, 2.0, 5.0] {
            let t = decade * m;
            if t >= lo * 0.9999 && t <= hi * 1.0001 {
                ticks.push(t);
            }
        }
        decade *= 10.0;
    }
    ticks
}

fn label(v: f64) -> String {
    if v >= 1.0 {
        format!("{v}")
    } else {
        format!("{v:.2}").trim_end_matches('0').to_owned()
    }
}

fn panel(svg: &mut String, y: &mut f64, p: &Panel) {
    let mut values: Vec<f64> = Vec::new();
    for r in &p.rows {
        if let Some(s) = r.summary {
            values.extend([s.min, s.max]);
        }
        values.extend(r.seed);
    }
    values.extend(p.target.as_ref().map(|t| t.0));
    values.retain(|v| *v > 0.0);
    let lo = values
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-3);
    let hi = values.iter().copied().fold(0.0, f64::max).max(lo * 2.0);
    // The nearest 1-2-5 steps outside the figures.
    let steps = |v: f64| {
        let decade = 10f64.powf(v.log10().floor());
        [1.0, 2.0, 5.0, 10.0].map(|m| m * decade)
    };
    let lo = steps(lo)
        .into_iter()
        .rev()
        .find(|&t| t <= lo * 1.0001)
        .unwrap_or(lo);
    let hi = steps(hi)
        .into_iter()
        .find(|&t| t >= hi * 0.9999)
        .unwrap_or(hi);
    let x = |v: f64| {
        LEFT + (v.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10()) * (RIGHT - LEFT)
    };
    let _ = writeln!(
        svg,
        r#"<text x="10" y="{:.1}" font-weight="bold" font-size="14">{}</text>"#,
        *y + 14.0,
        p.title
    );
    let top = *y + 24.0;
    let bottom = top + ROW * p.rows.len() as f64 + 4.0;
    for t in nice_ticks(lo, hi) {
        let _ = writeln!(
            svg,
            r##"<line x1="{0:.1}" y1="{top:.1}" x2="{0:.1}" y2="{bottom:.1}" stroke="#ddd"/><text x="{0:.1}" y="{1:.1}" font-size="11" text-anchor="middle">{2}</text>"##,
            x(t),
            bottom + 13.0,
            label(t)
        );
    }
    if let Some((t, text)) = &p.target {
        let _ = writeln!(
            svg,
            r##"<line x1="{0:.1}" y1="{top:.1}" x2="{0:.1}" y2="{bottom:.1}" stroke="#c00" stroke-dasharray="5,3"/><text x="{0:.1}" y="{1:.1}" font-size="11" fill="#c00" text-anchor="middle">{2}</text>"##,
            x(*t),
            top - 2.0,
            text
        );
    }
    for (i, r) in p.rows.iter().enumerate() {
        let cy = top + ROW * (i as f64 + 0.5) + 2.0;
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            cy + 4.0,
            r.label
        );
        if let Some(s) = r.summary {
            let _ = writeln!(
                svg,
                r##"<line x1="{:.1}" y1="{cy:.1}" x2="{:.1}" y2="{cy:.1}" stroke="#147" stroke-width="2"/><circle cx="{:.1}" cy="{cy:.1}" r="4" fill="#147"/>"##,
                x(s.min),
                x(s.max),
                x(s.median)
            );
        }
        if let Some(v) = r.seed {
            let (sx, d) = (x(v), 5.0);
            let _ = writeln!(
                svg,
                r##"<polygon points="{:.1},{cy:.1} {sx:.1},{:.1} {:.1},{cy:.1} {sx:.1},{:.1}" fill="none" stroke="#e80" stroke-width="2"/>"##,
                sx - d,
                cy - d,
                sx + d,
                cy + d
            );
        }
    }
    *y = bottom + 30.0;
}

fn med(results: &Results, key: &str) -> f64 {
    results.summary(key).map_or(0.0, |s| s.median)
}

/// Stacked medians of the eager resume + task: load, re-entry, the rest; the never-offloaded
/// task and 1.3× it as ticks.
fn stacked(svg: &mut String, y: &mut f64, results: &Results) {
    let mut rows = Vec::new();
    for content in Content::ALL {
        let c = content.name();
        for codec in [Codec::Raw, Codec::Lz4] {
            let n = codec.name();
            let total = med(results, &format!("vm.{c}.{n}-eager.resume_task_ms"));
            let load = med(results, &format!("vm.{c}.{n}-eager.resume_ms"));
            let reentry = med(results, &format!("vm.{c}.touch-{n}-eager.touch_extra_ms")).max(0.0);
            let base = med(results, &format!("vm.{c}.base.task_ms"));
            rows.push((format!("{c}, {n}, eager"), total, load, reentry, base));
        }
    }
    let hi = rows
        .iter()
        .map(|r| r.1.max(r.4 * 1.3))
        .fold(1.0, f64::max)
        .max(1.0);
    let step = [10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
        .into_iter()
        .find(|s| hi / s <= 8.0)
        .unwrap_or(1000.0);
    let hi = (hi / step).ceil() * step;
    let x = |v: f64| LEFT + v / hi * (RIGHT - LEFT);
    let _ = writeln!(
        svg,
        r#"<text x="10" y="{:.1}" font-weight="bold" font-size="14">Where eager resume + task goes, in process (medians, ms)</text>"#,
        *y + 14.0
    );
    let _ = writeln!(
        svg,
        r##"<text x="10" y="{:.1}" font-size="12"><tspan fill="#e80">■ eager load</tspan>  <tspan fill="#c33">■ re-entry (touch after the load − warm touch)</tspan>  <tspan fill="#147">■ the rest</tspan>  | black tick: never-offloaded task, red tick: 1.3× it</text>"##,
        *y + 32.0
    );
    let top = *y + 42.0;
    let bottom = top + ROW * rows.len() as f64 + 4.0;
    let mut t = 0.0;
    while t <= hi + 1e-9 {
        let _ = writeln!(
            svg,
            r##"<line x1="{0:.1}" y1="{top:.1}" x2="{0:.1}" y2="{bottom:.1}" stroke="#ddd"/><text x="{0:.1}" y="{1:.1}" font-size="11" text-anchor="middle">{t}</text>"##,
            x(t),
            bottom + 13.0
        );
        t += step;
    }
    for (i, (name, total, load, reentry, base)) in rows.iter().enumerate() {
        let cy = top + ROW * i as f64 + 3.0;
        let rest = (total - load - reentry).max(0.0);
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">{name}</text>"#,
            LEFT - 8.0,
            cy + 11.0
        );
        let mut at = 0.0;
        for (width, colour) in [(*load, "#e80"), (*reentry, "#c33"), (rest, "#147")] {
            let _ = writeln!(
                svg,
                r#"<rect x="{:.1}" y="{cy:.1}" width="{:.1}" height="{:.1}" fill="{colour}"/>"#,
                x(at),
                x(at + width) - x(at),
                ROW - 5.0
            );
            at += width;
        }
        for (v, colour) in [(*base, "#000"), (base * 1.3, "#c00")] {
            let _ = writeln!(
                svg,
                r#"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="{colour}" stroke-width="2"/>"#,
                x(v),
                cy - 2.0,
                cy + ROW - 3.0
            );
        }
    }
    *y = bottom + 30.0;
}

pub fn svg(results: &Results, settings: &Settings) -> String {
    let mut ratio = Vec::new();
    let mut pss = Vec::new();
    let mut backing = Vec::new();
    for content in Content::ALL {
        let c = content.name();
        let s = seed(content);
        for codec in [Codec::Raw, Codec::Lz4, Codec::Zstd] {
            let n = codec.name();
            let seed_of = |raw: f64, compressed: f64| match codec {
                Codec::Raw => Some(raw),
                Codec::Lz4 => Some(compressed),
                Codec::Zstd => None,
            };
            ratio.push(Row {
                label: format!("pvisor process: {c}, {n}, lazy"),
                summary: results.summary(&format!("pvisor.{c}.{n}.ratio")),
                seed: seed_of(s[0], s[1]),
            });
            for mode in ["lazy", "eager"] {
                if codec == Codec::Zstd && mode == "eager" {
                    continue;
                }
                ratio.push(Row {
                    label: format!("in process: {c}, {n}, {mode}"),
                    summary: results.summary(&format!("vm.{c}.{n}-{mode}.ratio")),
                    seed: None,
                });
            }
            pss.push(Row {
                label: format!("pvisor process: {c}, {n}"),
                summary: results.summary(&format!("pvisor.{c}.{n}.pss_offloaded_mib")),
                seed: seed_of(s[2], s[3]),
            });
            pss.push(Row {
                label: format!("bench process: {c}, {n}"),
                summary: results.summary(&format!("vm.{c}.{n}-lazy.pss_offloaded_mib")),
                seed: None,
            });
            backing.push(Row {
                label: format!("{c}, {n}"),
                summary: results.summary(&format!("vm.{c}.{n}-lazy.backing_mib")),
                seed: seed_of(s[4], s[5]),
            });
        }
    }
    let panels = [
        Panel {
            title: "Resume + task ÷ never-offloaded task, same run (lower is better; log scale)"
                .into(),
            rows: ratio,
            target: Some((1.3, "target 1.3×".into())),
        },
        Panel {
            title: "Whole-process PSS after offload, MiB (pvisor process = headline; log scale)"
                .into(),
            rows: pss,
            target: Some((4.0, "target 4 MiB".into())),
        },
        Panel {
            title: "Backing: allocated blocks of the store after offload, MiB (log scale)".into(),
            rows: backing,
            target: Some((1.0, "target 1 MiB (compressed, repeated)".into())),
        },
    ];
    let height = 60.0
        + panels
            .iter()
            .map(|p| p.rows.len() as f64 * ROW + 58.0)
            .sum::<f64>()
        + 4.0 * ROW
        + 80.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<text x="10" y="22" font-size="15">{} MiB VM, {} MiB of data, {} runs. Dot: median, whiskers: min–max, diamond: the seed (N=1), dashed: target.</text>"#,
        settings.memory >> 20,
        settings.app >> 20,
        settings.runs
    );
    let mut y = 40.0;
    for p in &panels {
        panel(&mut svg, &mut y, p);
    }
    stacked(&mut svg, &mut y, results);
    document(WIDTH, height, true, &svg)
}
