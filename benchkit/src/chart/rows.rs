//! Panels of labelled rows across one axis: each row a median dot with a min–max whisker (or a
//! bar from zero to the median), with the target and the seed's figure marked; or each row
//! stacked segments with marks.

use std::ops::Range;

use plotters::prelude::*;

use super::axis::{tick_value, Axis, Scale};
use super::{
    heading, legend, legend_rows, path, text, Area, Font, Panel, Stroke, AXIS, GRID, LEGEND_ROW,
    ORANGE, TARGET, WIDTH,
};
use crate::results::Summary;
use crate::Res;

/// The height of a row.
const ROW_H: i32 = 22;
/// Below the rows: the tick values.
const UNDER: i32 = 20;

/// One row: its label, its figures, its colour, the target and the seed's figure (a diamond),
/// if any.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub label: String,
    pub summary: Summary,
    pub colour: RGBColor,
    pub target: Option<f64>,
    pub seed: Option<f64>,
}

impl Row {
    pub fn new(label: impl Into<String>, summary: Summary, colour: RGBColor) -> Self {
        Self {
            label: label.into(),
            summary,
            colour,
            target: None,
            seed: None,
        }
    }
}

/// A titled panel of rows.
#[derive(Debug, Clone)]
pub struct Rows {
    pub title: String,
    pub scale: Scale,
    pub rows: Vec<Row>,
    /// Writes a tick value.
    pub tick: fn(f64) -> String,
    /// Writes the median right of the plot, if set.
    pub value: Option<fn(f64) -> String>,
    /// Whether the median is a bar from zero (else a dot).
    pub bars: bool,
    /// A target for every row, drawn as a dashed line down the panel with its label above.
    pub target: Option<(f64, String)>,
    /// Where the axis starts (the labels end left of it) and its width.
    pub plot: (i32, i32),
}

impl Rows {
    /// The panel of `rows` on `scale`, its ticks and values as `tick_value` writes them.
    pub fn new(title: impl Into<String>, scale: Scale, rows: Vec<Row>) -> Self {
        Self {
            title: title.into(),
            scale,
            rows,
            tick: tick_value,
            value: Some(tick_value),
            bars: false,
            target: None,
            plot: (330, 560),
        }
    }

    /// Every value the axis must hold.
    fn extent(&self) -> impl Iterator<Item = f64> + '_ {
        let rows = self.rows.iter().flat_map(|r| {
            let s = r.summary;
            [s.min, s.median, s.max]
                .into_iter()
                .chain(r.seed)
                .chain(r.target)
        });
        rows.chain(self.target.as_ref().map(|t| t.0))
    }
}

/// The drawn frame of a panel of rows: the axis and where it lies, in pixels.
struct Frame {
    axis: Axis,
    pixels: Range<i32>,
    /// The y of the first row's top.
    top: i32,
}

impl Frame {
    /// Draws the grid and the ticks of `axis` for `rows` rows from `top`, across `plot`, and
    /// each row's label.
    fn draw(
        root: &Area<'_>,
        top: i32,
        axis: Axis,
        (left, width): (i32, i32),
        labels: &[&str],
        tick: fn(f64) -> String,
    ) -> Res<Self> {
        let rows = i32::try_from(labels.len().max(1)).unwrap_or(i32::MAX / ROW_H) * ROW_H;
        let area = root.clone().shrink((0, top), (WIDTH, rows + UNDER));
        let mut chart = ChartBuilder::on(&area)
            .margin_right(WIDTH - left - width)
            .x_label_area_size(UNDER)
            .y_label_area_size(left)
            .build_cartesian_2d(axis.clone(), 0.0..1.0)?;
        let label = |u: &f64| tick(axis.value(*u));
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .bold_line_style(GRID)
            .axis_style(GRID)
            .x_labels(64)
            .x_label_formatter(&label)
            .label_style(Font::Tick.style())
            .draw()?;
        let frame = Frame {
            pixels: chart.plotting_area().get_pixel_range().0,
            axis,
            top,
        };
        if frame.axis.scale == Scale::Linear && frame.axis.lo < 0.0 {
            if let Some(x) = frame.x(0.0) {
                path(
                    root,
                    &[(x, top), (x, top + rows)],
                    Stroke::solid(AXIS).width(1),
                )?;
            }
        }
        for (i, label) in labels.iter().enumerate() {
            text(root, (left - 8, frame.y(i)), label, Font::Label)?;
        }
        Ok(frame)
    }

    /// Where `v` is drawn across (values beyond the axis at its ends); None for NaN.
    fn x(&self, v: f64) -> Option<i32> {
        let u = self.axis.at(v)?;
        let (lo, hi) = (self.axis.range().start, self.axis.range().end);
        let share = if hi > lo { (u - lo) / (hi - lo) } else { 0.0 };
        let span = f64::from(self.pixels.end - self.pixels.start);
        Some(self.pixels.start + (share * span).round() as i32)
    }

    /// The middle of row `i`.
    fn y(&self, i: usize) -> i32 {
        self.top + i32::try_from(i).unwrap_or(i32::MAX / ROW_H) * ROW_H + ROW_H / 2
    }

    /// A short vertical mark at `v` on the row whose middle is `y`.
    fn mark(&self, root: &Area<'_>, v: f64, y: i32, stroke: Stroke) -> Res<()> {
        match self.x(v) {
            Some(x) => path(root, &[(x, y - 9), (x, y + 9)], stroke),
            None => Ok(()),
        }
    }
}

impl Panel for Rows {
    fn height(&self) -> i32 {
        28 + i32::try_from(self.rows.len().max(1)).unwrap_or(0) * ROW_H + UNDER + 16
    }

    fn draw(&self, root: &Area<'_>, top: i32) -> Res<()> {
        heading(root, top + 12, &self.title)?;
        let axis = Axis::covering(self.scale, self.extent());
        let labels: Vec<&str> = self.rows.iter().map(|r| r.label.as_str()).collect();
        let f = Frame::draw(root, top + 28, axis, self.plot, &labels, self.tick)?;
        if let Some((v, label)) = &self.target {
            if let Some(x) = f.x(*v) {
                let bottom = f.y(self.rows.len()) - ROW_H / 2;
                path(root, &[(x, f.top), (x, bottom)], TARGET.width(1))?;
                let style = Font::Tick.style().color(&TARGET.colour);
                root.draw(&Text::new(label.clone(), (x, f.top - 6), style))?;
            }
        }
        for (i, row) in self.rows.iter().enumerate() {
            let (y, s, colour) = (f.y(i), row.summary, row.colour);
            if let Some(target) = row.target {
                f.mark(root, target, y, TARGET)?;
            }
            if let Some(seed) = row.seed.and_then(|v| f.x(v)) {
                let diamond = [
                    (seed - 5, y),
                    (seed, y - 5),
                    (seed + 5, y),
                    (seed, y + 5),
                    (seed - 5, y),
                ];
                path(root, &diamond, Stroke::solid(ORANGE))?;
            }
            let (Some(median), Some(min), Some(max)) = (f.x(s.median), f.x(s.min), f.x(s.max))
            else {
                text(root, (self.plot.0 + 4, y), "not measured", Font::Note)?;
                continue;
            };
            if self.bars {
                let zero = f.x(0.0).unwrap_or(f.pixels.start);
                let fill = colour.mix(0.55).filled();
                root.draw(&Rectangle::new(
                    [(zero.min(median), y - 6), (zero.max(median), y + 6)],
                    fill,
                ))?;
            } else {
                root.draw(&Circle::new((median, y), 4, colour.filled()))?;
            }
            let whisker = Stroke::solid(colour);
            path(root, &[(min, y), (max, y)], whisker)?;
            for x in [min, max] {
                path(root, &[(x, y - 4), (x, y + 4)], whisker)?;
            }
            if let Some(value) = self.value {
                let at = (self.plot.0 + self.plot.1 + 12, y);
                text(root, at, &value(s.median), Font::Value)?;
            }
        }
        Ok(())
    }
}

/// One row of stacked segments (each a length and its colour, from zero on) with marks (a
/// value and its colour).
#[derive(Debug, Clone, PartialEq)]
pub struct StackedRow {
    pub label: String,
    pub segments: Vec<(f64, RGBColor)>,
    pub marks: Vec<(f64, RGBColor)>,
}

/// A titled panel of stacked rows on a linear axis from zero, with a legend.
#[derive(Debug, Clone, PartialEq)]
pub struct Stacked {
    pub title: String,
    pub legend: Vec<(Stroke, String)>,
    pub rows: Vec<StackedRow>,
    /// Where the axis starts (the labels end left of it) and its width.
    pub plot: (i32, i32),
}

impl Stacked {
    fn rows_top(&self, top: i32) -> i32 {
        top + 28 + legend_rows(&self.legend, WIDTH - 20) * LEGEND_ROW
    }
}

impl Panel for Stacked {
    fn height(&self) -> i32 {
        let rows = i32::try_from(self.rows.len().max(1)).unwrap_or(0) * ROW_H;
        self.rows_top(0) + rows + UNDER + 16
    }

    fn draw(&self, root: &Area<'_>, top: i32) -> Res<()> {
        heading(root, top + 12, &self.title)?;
        legend(root, (10, top + 32), &self.legend, WIDTH - 20)?;
        let ends = self.rows.iter().flat_map(|r| {
            let total: f64 = r.segments.iter().map(|s| s.0.max(0.0)).sum();
            r.marks.iter().map(|m| m.0).chain([total])
        });
        let axis = Axis::covering(Scale::Linear, ends);
        let labels: Vec<&str> = self.rows.iter().map(|r| r.label.as_str()).collect();
        let f = Frame::draw(
            root,
            self.rows_top(top),
            axis,
            self.plot,
            &labels,
            tick_value,
        )?;
        for (i, row) in self.rows.iter().enumerate() {
            let y = f.y(i);
            let mut at = 0.0;
            for &(length, colour) in &row.segments {
                let length = length.max(0.0);
                if let (Some(a), Some(b)) = (f.x(at), f.x(at + length)) {
                    root.draw(&Rectangle::new([(a, y - 7), (b, y + 7)], colour.filled()))?;
                }
                at += length;
            }
            for &(v, colour) in &row.marks {
                f.mark(root, v, y, Stroke::solid(colour))?;
            }
        }
        Ok(())
    }
}
