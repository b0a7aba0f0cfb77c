use super::*;
use crate::results::Summary;

fn summary(values: &[f64]) -> Summary {
    Summary::of(values.iter().copied()).expect("values given")
}

/// Whether `svg` is one `<svg>` element whose tags all close (a small XML check: every
/// opened tag is closed in order, or closes itself).
fn well_formed(svg: &str) -> bool {
    let mut open: Vec<String> = Vec::new();
    let mut rest = svg;
    while let Some(start) = rest.find('<') {
        let Some(end) = rest[start..].find('>') else {
            return false;
        };
        let tag = &rest[start + 1..start + end];
        rest = &rest[start + end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
            continue;
        }
        let name = tag
            .trim_start_matches('/')
            .split_whitespace()
            .next()
            .unwrap_or("");
        if tag.starts_with('/') {
            if open.pop().as_deref() != Some(name) {
                return false;
            }
        } else {
            open.push(name.to_owned());
        }
    }
    open.is_empty() && crate::check_shape("svg", svg).is_ok()
}

fn memory(series: Vec<Series>, budget: Option<f64>) -> Lines {
    Lines {
        budget: budget.map(|b| (b, format!("budget {b} GiB"))),
        ..Lines::memory_over_time("Budget 2 GiB: memory of all the VMs", series)
    }
}

fn series(label: &str, points: Vec<(f64, f64)>) -> Series {
    Series {
        label: label.into(),
        stroke: Stroke::solid(BLUE),
        points,
    }
}

#[test]
fn lines_with_budget_draw_labels_and_budget_line() {
    let lines = memory(
        vec![
            series("off: 1.234", vec![(0.0, 0.5), (1.0, 1.5), (2.0, 1.0)]),
            Series {
                stroke: Stroke::dashed(RUST, 6, 3),
                ..series("offload-lazy: 0.5", vec![(0.0, 0.2), (2.0, 0.4)])
            },
        ],
        Some(2.0),
    );
    let svg = Figure::new("caption & <more>")
        .panel(lines)
        .svg()
        .expect("drawn");
    assert!(well_formed(&svg), "{svg}");
    for label in [
        "off: 1.234",
        "offload-lazy: 0.5",
        "budget 2 GiB",
        "caption &amp; &lt;more&gt;",
    ] {
        assert!(svg.contains(label), "{label} missing");
    }
    assert!(svg.contains("seconds after the common release"));
    // The budget line: dashes in its red.
    assert!(svg.matches("#CC0000").count() > 5, "{svg}");
}

#[test]
fn lines_empty_series_say_not_measured() {
    let lines = Lines {
        empty: "nothing to draw".into(),
        ..memory(vec![series("off", Vec::new())], None)
    };
    let svg = Figure::new("c").panel(lines).svg().expect("drawn");
    assert!(well_formed(&svg));
    assert!(svg.contains("nothing to draw"));
}

#[test]
fn lines_non_finite_points_break_the_line_without_panic() {
    let points = vec![
        (0.0, 1.0),
        (1.0, f64::NAN),
        (2.0, f64::INFINITY),
        (3.0, 2.0),
        (4.0, 2.5),
        (f64::NEG_INFINITY, 1.0),
    ];
    let svg = Figure::new("c")
        .panel(memory(vec![series("s", points)], Some(f64::NAN)))
        .svg()
        .expect("drawn");
    assert!(well_formed(&svg));
    // Only the budget's label says NaN: no coordinate does.
    assert_eq!(svg.matches("NaN").count(), 1, "{svg}");
    assert!(!svg.contains("inf"), "{svg}");
}

#[test]
fn rows_draw_labels_values_targets_and_seed() {
    let rows = vec![
        Row {
            target: Some(1.3),
            seed: Some(1.6),
            ..Row::new("lz4, lazy", summary(&[1.1, 1.2, 1.5]), GREEN)
        },
        Row::new("raw, lazy", summary(&[0.02, 0.03]), BLUE),
        Row::new("zstd: not run", Summary::NONE, BLUE),
    ];
    let panel = Rows {
        target: Some((4.0, "target 4 MiB".into())),
        ..Rows::new("1. Ratios (log scale)", Scale::Log, rows)
    };
    let svg = Figure::new("c").panel(panel).svg().expect("drawn");
    assert!(well_formed(&svg));
    for label in [
        "1. Ratios (log scale)",
        "lz4, lazy",
        "raw, lazy",
        "not measured",
        "target 4 MiB",
        "1.2",
    ] {
        assert!(svg.contains(label), "{label} missing");
    }
    // The seed's diamond is orange.
    assert!(svg.contains("#EE8800"), "{svg}");
}

#[test]
fn rows_linear_bars_hold_negative_values_and_nan() {
    let rows = vec![
        Row::new("saving", summary(&[-5.0, 10.0, 30.0]), PURPLE),
        Row::new("nan", Summary::NONE, PURPLE),
        Row::new(
            "inf",
            summary(&[f64::NEG_INFINITY, 1.0, f64::INFINITY]),
            PURPLE,
        ),
    ];
    let panel = Rows {
        bars: true,
        ..Rows::new("2. Saving, %", Scale::Linear, rows)
    };
    let svg = Figure::new("c").panel(panel).svg().expect("drawn");
    assert!(well_formed(&svg));
    assert!(svg.contains("<rect"));
}

#[test]
fn panels_with_no_rows_do_not_panic() {
    let svg = Figure::new("c")
        .panel(Rows::new("empty", Scale::Log, Vec::new()))
        .panel(Stacked {
            title: "empty".into(),
            legend: Vec::new(),
            rows: Vec::new(),
            plot: (400, 550),
        })
        .panel(memory(Vec::new(), None))
        .svg()
        .expect("drawn");
    assert!(well_formed(&svg));
}

#[test]
fn stacked_rows_draw_segments_marks_and_legend() {
    let panel = Stacked {
        title: "Where eager resume + task goes".into(),
        legend: vec![(Stroke::solid(ORANGE).width(8), "eager load".into())],
        rows: vec![StackedRow {
            label: "repeated, lz4, eager".into(),
            segments: vec![(120.0, ORANGE), (f64::NAN, RED), (300.0, NAVY)],
            marks: vec![(280.0, BLACK), (364.0, RED)],
        }],
        plot: (400, 550),
    };
    let svg = Figure::new("c").panel(panel).svg().expect("drawn");
    assert!(well_formed(&svg));
    for label in ["eager load", "repeated, lz4, eager"] {
        assert!(svg.contains(label), "{label} missing");
    }
}

#[test]
fn axis_log_covers_whole_decades_with_one_two_five_ticks() {
    let axis = axis::Axis::covering(Scale::Log, [0.3, 42.0, f64::NAN, -1.0]);
    assert_eq!((axis.lo, axis.hi), (0.1, 100.0));
    assert_eq!(axis.ticks.len(), 10);
    assert_eq!(axis.value(axis.at(20.0).expect("finite")), 20.0);
}

#[test]
fn axis_linear_holds_zero_and_steps_of_one_two_five() {
    let axis = axis::Axis::covering(Scale::Linear, [-3.0, 17.0]);
    assert_eq!((axis.lo, axis.hi), (-5.0, 20.0));
    assert_eq!(axis.ticks, vec![-5.0, 0.0, 5.0, 10.0, 15.0, 20.0]);
    assert_eq!(axis.at(f64::NAN), None);
    assert_eq!(axis.at(99.0), Some(20.0));
}
