//! The axes of the charts: a log axis over whole decades with a tick at 1, 2 and 5 per
//! decade, a linear one that holds zero and ends at a whole number of 1-2-5 steps. Values are
//! laid out in axis units (the logarithm on a log axis), so that plotters draws both on one
//! linear coordinate with these ticks as its key points.

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};

use crate::results::num;

/// How values are laid out across.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// Decades; values at or below zero are drawn at the axis' start.
    Log,
    /// From zero (or below, for negative values).
    Linear,
}

/// An axis that holds some values.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Axis {
    pub scale: Scale,
    pub lo: f64,
    pub hi: f64,
    /// The values of the grid lines, from `lo` to `hi`.
    pub ticks: Vec<f64>,
}

impl Axis {
    /// The most steps of a linear axis.
    const MAX_STEPS: f64 = 8.0;

    /// The axis of `scale` over every finite one of `values` (and zero on a linear axis; 0.1
    /// to 10 on a log axis with no positive value).
    pub fn covering(scale: Scale, values: impl IntoIterator<Item = f64>) -> Self {
        let values = values.into_iter().filter(|v| v.is_finite());
        match scale {
            Scale::Log => {
                let (lo, hi) = values
                    .filter(|&v| v > 0.0)
                    .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
                        (lo.min(v), hi.max(v))
                    });
                let (lo, hi) = if lo.is_finite() {
                    let lo = 10f64.powf(lo.log10().floor());
                    (lo, 10f64.powf(hi.log10().ceil()).max(lo * 10.0))
                } else {
                    (0.1, 10.0)
                };
                let mut ticks = Vec::new();
                let mut decade = lo;
                while decade <= hi * 1.0001 {
                    ticks.extend(
                        [1.0, 2.0, 5.0]
                            .map(|m| decade * m)
                            .into_iter()
                            .filter(|&v| v <= hi * 1.0001),
                    );
                    decade *= 10.0;
                }
                Self {
                    scale,
                    lo,
                    hi,
                    ticks,
                }
            }
            Scale::Linear => {
                let (lo, hi) = values.fold((0.0f64, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
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
                let lo = (lo / step).floor() * step;
                let hi = (hi / step).ceil().max(1.0) * step;
                let mut ticks = vec![lo];
                while let Some(&last) = ticks.last() {
                    let next = last + step;
                    if next > hi + step * 1e-6 {
                        break;
                    }
                    // Snapped to the step, so that 0.1 + 0.2 reads as 0.3.
                    ticks.push((next / step).round() * step);
                }
                Self {
                    scale,
                    lo,
                    hi,
                    ticks,
                }
            }
        }
    }

    /// Where `v` lies in axis units, within the axis (values beyond it at its ends); None
    /// for NaN.
    pub fn at(&self, v: f64) -> Option<f64> {
        if v.is_nan() {
            return None;
        }
        let v = v.clamp(self.lo, self.hi);
        Some(match self.scale {
            Scale::Log => v.log10(),
            Scale::Linear => v,
        })
    }

    /// The axis' ends in axis units.
    pub fn range(&self) -> Range<f64> {
        let end = |v: f64| self.at(v).unwrap_or(0.0);
        end(self.lo)..end(self.hi)
    }

    /// The ticks in axis units.
    pub fn key_points(&self) -> Vec<f64> {
        self.ticks.iter().filter_map(|&v| self.at(v)).collect()
    }

    /// The value at `u` axis units: the tick there, if one is.
    pub fn value(&self, u: f64) -> f64 {
        let tick = self.ticks.iter().copied().find(|&t| {
            self.at(t)
                .is_some_and(|at| (at - u).abs() < 1e-9 * u.abs().max(1.0))
        });
        tick.unwrap_or(match self.scale {
            Scale::Linear => u,
            Scale::Log => 10f64.powf(u),
        })
    }
}

/// Plotters lays the axis out in axis units, with a grid line at each tick.
impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, u: &f64, (from, to): (i32, i32)) -> i32 {
        let Range { start, end } = Axis::range(self);
        let share = if end > start {
            (u - start) / (end - start)
        } else {
            0.0
        };
        from + (share * f64::from(to - from)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            Axis::key_points(self)
        }
    }

    fn range(&self) -> Range<f64> {
        Axis::range(self)
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
