//! The pieces of the report charts: the document, text and lines, a log axis over whole decades
//! with a grid at 1, 2 and 5 per decade, panels of labelled rows on such an axis, and a linear
//! axis from zero with a 1-2-5 step.

use std::fmt::Write as _;

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
