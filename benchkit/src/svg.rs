//! The pieces of the report charts: the document, text and lines, a log axis over whole decades
//! with a grid at 1, 2 and 5 per decade, panels of labelled rows on such an axis, and a linear
//! axis from zero with a 1-2-5 step.

use std::fmt::Write as _;

use super::results::num;

/// The height of a panel's row.
pub const ROW_H: f64 = 22.0;

/// An SVG document of `width` × `height` on white around `body`, with a `viewBox` if
/// `view_box`.
pub fn document(width: f64, height: f64, view_box: bool, body: &str) -> String {
    let view_box = if view_box {
        format!(r#" viewBox="0 0 {width:.0} {height:.0}""#)
    } else {
        String::new()
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}"{view_box} font-family="sans-serif">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    out.push_str(body);
    out.push_str("</svg>\n");
    out
}

fn esc(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// `content`, escaped, at (`x`, `y`).
pub fn text(out: &mut String, x: f64, y: f64, attributes: &str, content: &str) {
    let _ = writeln!(
        out,
        r#"<text x="{x:.1}" y="{y:.1}" {attributes}>{}</text>"#,
        esc(content)
    );
}

pub fn line(out: &mut String, (x1, y1): (f64, f64), (x2, y2): (f64, f64), style: &str) {
    let _ = writeln!(
        out,
        r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#
    );
}

/// A log-scale axis from `lo` to `hi`, whole decades, drawn from `left` over `width`.
#[derive(Debug, Clone, Copy)]
pub struct LogAxis {
    pub lo: f64,
    pub hi: f64,
    left: f64,
    width: f64,
    /// Whether values beyond the axis are drawn at its ends.
    clamp: bool,
}

impl LogAxis {
    /// The decades that hold every finite positive one of `values` (0.1 to 10 if none is).
    pub fn covering(values: impl IntoIterator<Item = f64>, left: f64, width: f64) -> Self {
        let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
        for v in values {
            if v.is_finite() && v > 0.0 {
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
        let (lo, hi) = if lo.is_finite() {
            let lo = 10f64.powf(lo.log10().floor());
            (lo, 10f64.powf(hi.log10().ceil()).max(lo * 10.0))
        } else {
            (0.1, 10.0)
        };
        Self {
            lo,
            hi,
            left,
            width,
            clamp: false,
        }
    }

    /// The same axis, drawing values beyond it at its ends.
    pub fn clamped(self) -> Self {
        Self {
            clamp: true,
            ..self
        }
    }

    /// Where `v` is drawn.
    pub fn x(&self, v: f64) -> f64 {
        let (lo, hi) = (self.lo, self.hi);
        let v = if self.clamp { v.clamp(lo, hi) } else { v };
        self.left + (v.ln() - lo.ln()) / (hi.ln() - lo.ln()) * self.width
    }

    /// 1, 2 and 5 times each decade, from `lo` to `hi`.
    pub fn ticks(&self) -> Vec<f64> {
        let mut ticks = Vec::new();
        let mut decade = self.lo;
        while decade <= self.hi * 1.0001 {
            for v in [1.0, 2.0, 5.0].map(|m| decade * m) {
                if v > self.hi * 1.0001 {
                    break;
                }
                ticks.push(v);
            }
            decade *= 10.0;
        }
        ticks
    }
}

/// What a panel needs of its axis.
pub trait Axis: Copy {
    /// Where `v` is drawn.
    fn x(&self, v: f64) -> f64;
    /// The values of the grid lines.
    fn ticks(&self) -> Vec<f64>;
    /// Where the axis starts (row labels end left of it).
    fn left(&self) -> f64;
}

impl Axis for LogAxis {
    fn x(&self, v: f64) -> f64 {
        LogAxis::x(self, v)
    }

    fn ticks(&self) -> Vec<f64> {
        LogAxis::ticks(self)
    }

    fn left(&self) -> f64 {
        self.left
    }
}

/// A panel: a bold title, then one row per quantity, labelled left of an axis (a log axis
/// unless told otherwise) with a grid.
#[derive(Debug, Clone, Copy)]
pub struct Panel<A: Axis = LogAxis> {
    pub axis: A,
    /// The y of the first row's top.
    pub top: f64,
    /// The y below the last row.
    pub bottom: f64,
}

impl<A: Axis> Panel<A> {
    /// Draws the title at `y0` and the grid of `rows` rows, with the tick values written by
    /// `tick` (in `tick_attributes`) below it.
    pub fn begin(
        out: &mut String,
        y0: f64,
        title: &str,
        axis: A,
        rows: usize,
        (tick_attributes, tick): (&str, fn(f64) -> String),
    ) -> Self {
        text(
            out,
            10.0,
            y0 + 16.0,
            r#"font-weight="bold" font-size="14""#,
            title,
        );
        let top = y0 + 28.0;
        let bottom = top + ROW_H * rows as f64;
        for v in axis.ticks() {
            let x = axis.x(v);
            line(out, (x, top), (x, bottom), r##"stroke="#ddd""##);
            text(out, x, bottom + 14.0, tick_attributes, &tick(v));
        }
        Self { axis, top, bottom }
    }

    /// Writes the label of row `i` left of the axis; returns the row's centre line.
    pub fn row(&self, out: &mut String, i: usize, label: &str) -> f64 {
        let cy = self.top + ROW_H * (i as f64 + 0.5);
        let attributes = r#"font-size="12" text-anchor="end""#;
        text(out, self.axis.left() - 8.0, cy + 4.0, attributes, label);
        cy
    }
}

/// A linear axis that starts at zero (or below, for negative values) and ends at a whole
/// number of steps, drawn from `left` over `width`, with a grid line every step (1, 2 or 5
/// times a power of ten, at most `MAX_STEPS` of them).
#[derive(Debug, Clone, Copy)]
pub struct LinearAxis {
    pub lo: f64,
    pub hi: f64,
    pub step: f64,
    left: f64,
    width: f64,
}

impl LinearAxis {
    const MAX_STEPS: f64 = 8.0;

    /// The axis over zero and every finite one of `values`.
    pub fn from_zero(values: impl IntoIterator<Item = f64>, left: f64, width: f64) -> Self {
        let (lo, hi) = values
            .into_iter()
            .filter(|v| v.is_finite())
            .fold((0.0f64, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
        let span = if hi > lo { hi - lo } else { 1.0 };
        // The smallest 1-2-5 step that covers the span in at most MAX_STEPS steps.
        let mut decade = 10f64.powf((span / Self::MAX_STEPS).log10().floor());
        let step = loop {
            if let Some(step) = [1.0, 2.0, 5.0]
                .iter()
                .map(|m| m * decade)
                .find(|s| span / s <= Self::MAX_STEPS)
            {
                break step;
            }
            decade *= 10.0;
        };
        Self {
            lo: (lo / step).floor() * step,
            hi: (hi / step).ceil().max(1.0) * step,
            step,
            left,
            width,
        }
    }
}

impl Axis for LinearAxis {
    /// Values beyond the axis are drawn at its ends.
    fn x(&self, v: f64) -> f64 {
        let v = v.clamp(self.lo, self.hi);
        self.left + (v - self.lo) / (self.hi - self.lo) * self.width
    }

    /// Every step from `lo` to `hi`.
    fn ticks(&self) -> Vec<f64> {
        let mut ticks = vec![self.lo];
        while let Some(&last) = ticks.last() {
            let next = last + self.step;
            if next > self.hi + self.step * 1e-6 {
                break;
            }
            // Snap to the step, so that 0.1 + 0.2 reads as 0.3.
            ticks.push((next / self.step).round() * self.step);
        }
        ticks
    }

    fn left(&self) -> f64 {
        self.left
    }
}

/// A chart of lines over two linear axes from zero (`LinearAxis`): time or another quantity
/// across, a quantity up, in the box from (`left`, `top`) of `width` × `height`, with a grid at
/// every step of both axes, their tick values below and left of the box, and their titles.
#[derive(Debug, Clone, Copy)]
pub struct LineChart {
    pub x: LinearAxis,
    /// Laid out from 0 over the box's height; `LineChart::at` turns it upwards.
    pub y: LinearAxis,
    pub top: f64,
    pub height: f64,
}

/// Where a `LineChart` is drawn and what its axes say.
#[derive(Debug, Clone, Copy)]
pub struct ChartFrame<'a> {
    pub left: f64,
    pub top: f64,
    pub width: f64,
    pub height: f64,
    /// The title below the horizontal axis.
    pub x_title: &'a str,
    /// The title above the vertical axis.
    pub y_title: &'a str,
    /// Writes a tick value.
    pub tick: fn(f64) -> String,
}

impl LineChart {
    /// Draws the grid, the ticks and the titles of a chart that holds every finite one of
    /// `xs` and `ys` (and zero).
    pub fn begin(
        out: &mut String,
        frame: &ChartFrame<'_>,
        xs: impl IntoIterator<Item = f64>,
        ys: impl IntoIterator<Item = f64>,
    ) -> Self {
        let chart = Self {
            x: LinearAxis::from_zero(xs, frame.left, frame.width),
            y: LinearAxis::from_zero(ys, 0.0, frame.height),
            top: frame.top,
            height: frame.height,
        };
        let right = frame.left + frame.width;
        let bottom = chart.bottom();
        let small = r#"font-size="10" text-anchor="middle""#;
        for v in chart.x.ticks() {
            let x = chart.x.x(v);
            line(out, (x, frame.top), (x, bottom), r##"stroke="#ddd""##);
            text(out, x, bottom + 14.0, small, &(frame.tick)(v));
        }
        for v in chart.y.ticks() {
            let (_, y) = chart.at(chart.x.lo, v);
            line(out, (frame.left, y), (right, y), r##"stroke="#ddd""##);
            let attributes = r#"font-size="10" text-anchor="end""#;
            text(out, frame.left - 6.0, y + 3.5, attributes, &(frame.tick)(v));
        }
        let axis = r##"stroke="#888""##;
        line(out, (frame.left, bottom), (right, bottom), axis);
        line(out, (frame.left, frame.top), (frame.left, bottom), axis);
        let centre = frame.left + frame.width / 2.0;
        text(
            out,
            centre,
            bottom + 30.0,
            r#"font-size="11" text-anchor="middle""#,
            frame.x_title,
        );
        text(
            out,
            frame.left,
            frame.top - 8.0,
            r#"font-size="11""#,
            frame.y_title,
        );
        chart
    }

    /// The y below the box.
    pub fn bottom(&self) -> f64 {
        self.top + self.height
    }

    /// Where the point (`x`, `y`) is drawn (values beyond the axes at their ends).
    pub fn at(&self, x: f64, y: f64) -> (f64, f64) {
        (self.x.x(x), self.bottom() - self.y.x(y))
    }

    /// A line through `points` in `style` (SVG attributes: `stroke="…"`); a point with a value
    /// that is not finite breaks the line.
    pub fn polyline(&self, out: &mut String, points: &[(f64, f64)], style: &str) {
        for run in points.split(|(x, y)| !(x.is_finite() && y.is_finite())) {
            if run.len() < 2 {
                continue;
            }
            let coordinates: Vec<String> = run
                .iter()
                .map(|&(x, y)| {
                    let (x, y) = self.at(x, y);
                    format!("{x:.1},{y:.1}")
                })
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" {style}/>"#,
                coordinates.join(" ")
            );
        }
    }
}

/// A tick value: whole numbers bare, others to one or two decimals.
pub fn tick_value(v: f64) -> String {
    if v.fract() == 0.0 {
        num(v, 0)
    } else if (v * 10.0).fract().abs() < 1e-9 {
        num(v, 1)
    } else {
        num(v, 2)
    }
}

/// The frame of a chart of memory (GiB) over the seconds of a replay, in the box from
/// (`left`, `top`) of `width` × `height`.
pub fn memory_time_frame(left: f64, top: f64, width: f64, height: f64) -> ChartFrame<'static> {
    ChartFrame {
        left,
        top,
        width,
        height,
        x_title: "seconds after the common release",
        y_title: "GiB",
        tick: tick_value,
    }
}

/// A panel's bold title at (10, `y`).
pub fn heading(out: &mut String, y: f64, content: &str) {
    text(
        out,
        10.0,
        y,
        r#"font-weight="bold" font-size="14""#,
        content,
    );
}

/// A legend in one row from (`x`, `y`): a short line in each entry's style (`stroke="…"`),
/// then its label.
pub fn legend(out: &mut String, (x, y): (f64, f64), entries: &[(&str, String)]) {
    let mut x = x;
    for (style, label) in entries {
        line(out, (x, y - 4.0), (x + 22.0, y - 4.0), style);
        text(out, x + 28.0, y, r#"font-size="11""#, label);
        // About 6.5 px a character at 11 px.
        x += 28.0 + 6.5 * label.chars().count() as f64 + 18.0;
    }
}
