//! Quantities over time: several series on two linear axes from zero, a legend above, and a
//! budget as a dashed level.

use plotters::prelude::*;

use super::axis::{tick_value, Axis, Scale};
use super::{
    heading, legend, legend_rows, text, Area, Font, Panel, Stroke, AXIS, GRID, LEGEND_ROW, RED,
    WIDTH,
};
use crate::Res;

/// One series: its legend label, its stroke and its points (a point that is not finite breaks
/// the line).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub stroke: Stroke,
    pub points: Vec<(f64, f64)>,
}

/// A panel of series over time.
#[derive(Debug, Clone, PartialEq)]
pub struct Lines {
    pub title: String,
    pub series: Vec<Series>,
    /// A level drawn as a dashed red line across, with its legend label.
    pub budget: Option<(f64, String)>,
    /// Said in the plot when no series has a line to draw.
    pub empty: String,
    pub x_title: &'static str,
    pub y_title: &'static str,
}

/// The budget's stroke.
pub const BUDGET: Stroke = Stroke::dashed(RED, 7, 4);

const PLOT_X: i32 = 80;
const PLOT_W: i32 = 860;
const PLOT_H: i32 = 260;
/// Below the plot: the tick values and the horizontal axis' title.
const UNDER: i32 = 40;

impl Lines {
    /// A chart of memory (GiB) over the seconds of a replay.
    pub fn memory_over_time(title: impl Into<String>, series: Vec<Series>) -> Self {
        Self {
            title: title.into(),
            series,
            budget: None,
            empty: "not measured".into(),
            x_title: "seconds after the common release",
            y_title: "GiB",
        }
    }

    fn legend(&self) -> Vec<(Stroke, String)> {
        let series = self.series.iter().map(|s| (s.stroke, s.label.clone()));
        let budget = self.budget.iter().map(|(_, label)| (BUDGET, label.clone()));
        series.chain(budget).collect()
    }

    /// The y of the plot's top, from the panel's `top`.
    fn plot_top(&self, top: i32) -> i32 {
        top + 36 + legend_rows(&self.legend(), PLOT_W) * LEGEND_ROW
    }
}

fn finite(&(x, y): &(f64, f64)) -> bool {
    x.is_finite() && y.is_finite()
}

impl Panel for Lines {
    fn height(&self) -> i32 {
        self.plot_top(0) + 10 + PLOT_H + UNDER + 20
    }

    fn draw(&self, root: &Area<'_>, top: i32) -> Res<()> {
        heading(root, top + 12, &self.title)?;
        legend(root, (PLOT_X, top + 32), &self.legend(), PLOT_W)?;
        let points = || {
            self.series
                .iter()
                .flat_map(|s| s.points.iter().filter(|p| finite(p)))
        };
        let x = Axis::covering(Scale::Linear, points().map(|p| p.0));
        let levels = self.budget.iter().map(|b| b.0);
        let y = Axis::covering(Scale::Linear, points().map(|p| p.1).chain(levels));
        let plot_top = self.plot_top(top);
        let area = root
            .clone()
            .shrink((0, plot_top), (WIDTH, 10 + PLOT_H + UNDER));
        let mut chart = ChartBuilder::on(&area)
            .margin_top(10)
            .margin_right(WIDTH - PLOT_X - PLOT_W)
            .x_label_area_size(UNDER)
            .y_label_area_size(PLOT_X)
            .build_cartesian_2d(x.clone(), y.clone())?;
        let ticks = Font::Tick.style();
        chart
            .configure_mesh()
            .bold_line_style(GRID)
            .axis_style(AXIS)
            .x_labels(64)
            .y_labels(64)
            .x_label_formatter(&|v| tick_value(x.value(*v)))
            .y_label_formatter(&|v| tick_value(*v))
            .label_style(ticks.clone())
            .axis_desc_style(ticks)
            .x_desc(self.x_title)
            .y_desc(self.y_title)
            .draw()?;
        if let Some((level, _)) = self.budget {
            let (from, to) = (x.range().start, x.range().end);
            let style = BUDGET.style();
            let line = [(from, level), (to, level)];
            let (dash, gap) = BUDGET.dash.unwrap_or((7, 4));
            chart.draw_series(DashedLineSeries::new(line, dash, gap, style))?;
        }
        let mut drawn = false;
        for s in &self.series {
            for run in s.points.split(|p| !finite(p)).filter(|run| run.len() >= 2) {
                let run = run
                    .iter()
                    .map(|&(px, py)| (x.at(px).unwrap_or(0.0), y.at(py).unwrap_or(0.0)));
                match s.stroke.dash {
                    None => chart.draw_series(LineSeries::new(run, s.stroke.style()))?,
                    Some((dash, gap)) => chart.draw_series(DashedLineSeries::new(
                        run.collect::<Vec<_>>(),
                        dash,
                        gap,
                        s.stroke.style(),
                    ))?,
                };
                drawn = true;
            }
        }
        if !drawn {
            text(root, (PLOT_X + 8, plot_top + 30), &self.empty, Font::Note)?;
        }
        Ok(())
    }
}
