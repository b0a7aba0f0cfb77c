//! The reports' charts, drawn with `plotters` on its SVG backend (which writes `<text>`
//! elements and needs no fonts). A [`Figure`] is a caption over panels stacked top to bottom,
//! each of one kind:
//! - [`Lines`]: quantities over time, several series and a budget drawn as a dashed level
//!   (memory over time);
//! - [`Rows`]: labelled rows, each a median dot with a min–max whisker (or a bar from zero), on
//!   a log axis or a linear one that holds zero, with targets and the seed's figures marked;
//! - [`Stacked`]: labelled rows of stacked segments on a linear axis from zero, with marks.

mod axis;
mod lines;
mod rows;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub use axis::{tick_value, Scale};
pub use lines::{Lines, Series};
pub use plotters::style::RGBColor as Colour;
pub use rows::{Row, Rows, Stacked, StackedRow};

use crate::Res;

/// The width of every chart.
pub const WIDTH: i32 = 980;

pub const BLUE: RGBColor = RGBColor(0x33, 0x66, 0x99);
pub const NAVY: RGBColor = RGBColor(0x11, 0x44, 0x77);
pub const GREEN: RGBColor = RGBColor(0x22, 0x88, 0x33);
pub const PURPLE: RGBColor = RGBColor(0x88, 0x44, 0x99);
pub const VIOLET: RGBColor = RGBColor(0xaa, 0x44, 0xcc);
pub const RUST: RGBColor = RGBColor(0xcc, 0x66, 0x33);
pub const ORANGE: RGBColor = RGBColor(0xee, 0x88, 0x00);
pub const RED: RGBColor = RGBColor(0xcc, 0x00, 0x00);
pub const GREY: RGBColor = RGBColor(0x55, 0x55, 0x55);
pub const INK: RGBColor = RGBColor(0x11, 0x11, 0x11);
pub const BLACK: RGBColor = RGBColor(0, 0, 0);
const GRID: RGBColor = RGBColor(0xdd, 0xdd, 0xdd);
const AXIS: RGBColor = RGBColor(0x88, 0x88, 0x88);

/// How a line is drawn: its colour, width in pixels and, if dashed, the dash and gap lengths.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stroke {
    pub colour: RGBColor,
    pub width: u32,
    pub dash: Option<(i32, i32)>,
}

impl Stroke {
    pub const fn solid(colour: RGBColor) -> Self {
        Self {
            colour,
            width: 2,
            dash: None,
        }
    }

    pub const fn dashed(colour: RGBColor, dash: i32, gap: i32) -> Self {
        Self {
            colour,
            width: 2,
            dash: Some((dash, gap)),
        }
    }

    pub const fn width(self, width: u32) -> Self {
        Self { width, ..self }
    }

    fn style(&self) -> ShapeStyle {
        self.colour.stroke_width(self.width)
    }
}

/// The target's stroke: red dashes.
pub const TARGET: Stroke = Stroke::dashed(RED, 3, 2);

/// The drawing of a whole figure, in pixels from its top left.
pub type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// A panel of a figure.
pub trait Panel: std::fmt::Debug {
    /// Its height in pixels.
    fn height(&self) -> i32;
    /// Draws it from `top` down.
    fn draw(&self, root: &Area<'_>, top: i32) -> Res<()>;
}

/// A caption over panels.
#[derive(Debug)]
pub struct Figure {
    caption: String,
    panels: Vec<Box<dyn Panel>>,
}

const CAPTION_H: i32 = 32;

impl Figure {
    pub fn new(caption: impl Into<String>) -> Self {
        Self {
            caption: caption.into(),
            panels: Vec::new(),
        }
    }

    /// The figure with `panel` below the others.
    pub fn panel(mut self, panel: impl Panel + 'static) -> Self {
        self.panels.push(Box::new(panel));
        self
    }

    /// The SVG document.
    pub fn svg(&self) -> Res<String> {
        let height = CAPTION_H + self.panels.iter().map(|p| p.height()).sum::<i32>() + 10;
        let size = (px(WIDTH), px(height));
        let mut out = String::new();
        {
            let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
            root.fill(&WHITE)?;
            text(&root, (10, 20), &self.caption, Font::Caption)?;
            let mut top = CAPTION_H;
            for panel in &self.panels {
                panel.draw(&root, top)?;
                top += panel.height();
            }
            root.present()?;
        }
        Ok(out)
    }
}

/// A pixel length as the backend takes it (negative ones as 0).
fn px(v: i32) -> u32 {
    u32::try_from(v).unwrap_or(0)
}

/// The kinds of text of a chart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Font {
    Caption,
    Heading,
    /// A row's label, right-aligned.
    Label,
    /// A figure or legend entry, left-aligned.
    Value,
    /// Said where nothing is drawn.
    Note,
    /// A tick value or an axis title.
    Tick,
}

impl Font {
    fn style(self) -> TextStyle<'static> {
        let (size, colour, anchor) = match self {
            Font::Caption | Font::Heading => (14.0, &BLACK, HPos::Left),
            Font::Label => (12.0, &BLACK, HPos::Right),
            Font::Value => (11.0, &BLACK, HPos::Left),
            Font::Note => (12.0, &AXIS, HPos::Left),
            Font::Tick => (10.0, &BLACK, HPos::Center),
        };
        let weight = if self == Font::Heading {
            FontStyle::Bold
        } else {
            FontStyle::Normal
        };
        // The SVG backend writes a font size of size / 1.24.
        FontDesc::new(FontFamily::SansSerif, size * 1.24, weight)
            .color(colour)
            .pos(Pos::new(anchor, VPos::Center))
    }
}

/// `content` at `at` (its left, right or centre by `font`, its middle height).
fn text(root: &Area<'_>, at: (i32, i32), content: &str, font: Font) -> Res<()> {
    root.draw(&Text::new(content.to_owned(), at, font.style()))?;
    Ok(())
}

/// A line through `points` (pixels) in `stroke`.
fn path(root: &Area<'_>, points: &[(i32, i32)], stroke: Stroke) -> Res<()> {
    match stroke.dash {
        None => root.draw(&PathElement::new(points.to_vec(), stroke.style()))?,
        Some((dash, gap)) => root.draw(&DashedPathElement::new(
            points.to_vec(),
            dash,
            gap,
            stroke.style(),
        ))?,
    }
    Ok(())
}

const LEGEND_ROW: i32 = 18;

/// Where each legend entry starts, (x offset, row), when entries run in rows of at most
/// `width` pixels: a 22-pixel stroke, then the label (about 6.5 pixels a character).
fn legend_layout(entries: &[(Stroke, String)], width: i32) -> Vec<(i32, i32)> {
    let mut at = Vec::with_capacity(entries.len());
    let (mut x, mut row) = (0, 0);
    for (_, label) in entries {
        let chars = i32::try_from(label.chars().count()).unwrap_or(i32::MAX / 8);
        let w = 28 + chars.saturating_mul(13) / 2 + 18;
        if x > 0 && x + w > width {
            x = 0;
            row += 1;
        }
        at.push((x, row));
        x += w;
    }
    at
}

/// The legend's rows.
fn legend_rows(entries: &[(Stroke, String)], width: i32) -> i32 {
    legend_layout(entries, width)
        .last()
        .map_or(0, |&(_, row)| row + 1)
}

/// The legend of `entries` from (`x`, `y`), in rows of at most `width` pixels.
fn legend(
    root: &Area<'_>,
    (x, y): (i32, i32),
    entries: &[(Stroke, String)],
    width: i32,
) -> Res<()> {
    for ((stroke, label), (dx, row)) in entries.iter().zip(legend_layout(entries, width)) {
        let (x, y) = (x + dx, y + row * LEGEND_ROW);
        path(root, &[(x, y), (x + 22, y)], *stroke)?;
        text(root, (x + 28, y), label, Font::Value)?;
    }
    Ok(())
}

/// A panel's bold title whose middle is at `y`.
fn heading(root: &Area<'_>, y: i32, title: &str) -> Res<()> {
    text(root, (10, y), title, Font::Heading)
}

#[cfg(test)]
mod tests;
