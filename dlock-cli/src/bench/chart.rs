//! `bench.svg`: two bar charts side by side, latencies (µs) and rates
//! (per second), one group of bars per backend, both on log scales.
//!
//! Drawn with plotters' SVG backend only: text is emitted as SVG `<text>`
//! elements and laid out by the viewer, so no font files or font libraries
//! are needed to build or run.

use std::fmt::Display;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::report::{BackendReport, Report};

/// Picture size in pixels.
const SIZE: (u32, u32) = (1200, 520);

/// Bar colours of the latency panel, in series order.
const LATENCY_COLOURS: [RGBColor; 5] = [
    RGBColor(0x9e, 0x9e, 0x9e),
    RGBColor(0x5d, 0x5d, 0x5d),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
];

/// Bar colours of the throughput panel, in series order.
const RATE_COLOURS: [RGBColor; 3] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0x2c, 0xa0, 0x2c),
];

/// A named row of values, one per backend (`None`: not measured).
struct Series<'a> {
    /// The legend text.
    name: &'a str,
    /// The bars' colour.
    colour: RGBColor,
    /// One value per backend.
    values: Vec<Option<f64>>,
}

/// What one series shows of a backend (`None`: not measured).
type Value = fn(&BackendReport) -> Option<f64>;

/// One series per `(name, value)` of `rows`, coloured in order from
/// `colours` (one each): `value` of each backend in `report`.
fn series<'a, const N: usize>(
    report: &Report,
    colours: &[RGBColor; N],
    rows: &[(&'a str, Value); N],
) -> Vec<Series<'a>> {
    rows.iter()
        .zip(colours)
        .map(|(&(name, value), &colour)| Series {
            name,
            colour,
            values: report.backends.iter().map(value).collect(),
        })
        .collect()
}

/// The SVG document for `report`.
pub(crate) fn svg(report: &Report) -> Result<String, String> {
    let labels: Vec<&str> = report.backends.iter().map(|b| b.backend.as_str()).collect();
    let latency = series(
        report,
        &LATENCY_COLOURS,
        &[
            ("baseline (ping) p50", |b| b.baseline.map(|l| l.p50_us)),
            ("raw floor (take+release) p50", |b| {
                b.floor.as_ref().and_then(|f| f.latency).map(|l| l.p50_us)
            }),
            ("acquire+release p50", |b| {
                b.acquire_release.map(|l| l.p50_us)
            }),
            ("hot lock release→grant p50", |b| {
                b.hot_lock.release_to_grant.map(|l| l.p50_us)
            }),
            ("native lock release→grant p50", |b| {
                (b.native_lock.as_ref())
                    .and_then(|n| n.hot_lock.release_to_grant)
                    .map(|l| l.p50_us)
            }),
        ],
    );
    let rates = series(
        report,
        &RATE_COLOURS,
        &[
            ("hot-lock handoffs/s", |b| Some(b.hot_lock.handoffs_per_s)),
            ("native lock handoffs/s", |b| {
                b.native_lock.as_ref().map(|n| n.hot_lock.handoffs_per_s)
            }),
            ("independent locks: acquisitions/s", |b| {
                Some(b.independent.per_s)
            }),
        ],
    );
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let title = format!(
            "dlock bench, {} ({} clients per backend)",
            report.date, report.settings.clients
        );
        let body = root.titled(&title, ("sans-serif", 20)).map_err(err)?;
        let (left, right) = body.split_horizontally(SIZE.0 * 11 / 20);
        panel(
            &root,
            &left,
            "latency (p50, µs, log scale)",
            &labels,
            &latency,
            short_us,
        )?;
        panel(
            &root,
            &right,
            "throughput (per second, log scale)",
            &labels,
            &rates,
            short_rate,
        )?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// One bar chart on `area` (part of `root`): a group of bars per label, one
/// bar per series, values written above the bars by `show`.
fn panel(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    labels: &[&str],
    series: &[Series<'_>],
    show: impl Fn(f64) -> String,
) -> Result<(), String> {
    let (low, high) = log_bounds(
        series
            .iter()
            .flat_map(|s| s.values.iter().flatten().copied()),
    );
    let groups = labels.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..groups, (low..high).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_label_formatter(&|v| si(*v))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(err)?;

    let width = 0.8 / series.len().max(1) as f64;
    for (k, s) in series.iter().enumerate() {
        let colour = s.colour;
        let bars = s.values.iter().enumerate().filter_map(|(i, v)| {
            let v = (*v).filter(|v| *v > 0.0)?;
            let x0 = i as f64 + 0.1 + k as f64 * width;
            Some(Rectangle::new(
                [(x0, low), (x0 + width * 0.92, v)],
                colour.filled(),
            ))
        });
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(s.name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
        let values = s.values.iter().enumerate().filter_map(|(i, v)| {
            let v = (*v).filter(|v| *v > 0.0)?;
            let x = i as f64 + 0.1 + (k as f64 + 0.46) * width;
            let style = TextStyle::from(("sans-serif", 10))
                .pos(Pos::new(HPos::Center, VPos::Bottom))
                .color(&BLACK);
            Some(Text::new(show(v), (x, v), style))
        });
        chart.draw_series(values).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .draw()
        .map_err(err)?;

    // Backend names under their groups, placed in picture coordinates.
    let style = TextStyle::from(("sans-serif", 13)).pos(Pos::new(HPos::Center, VPos::Top));
    for (i, label) in labels.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, low));
        root.draw(&Text::new(label.to_string(), (x, y + 6), style.clone()))
            .map_err(err)?;
    }
    Ok(())
}

/// Whole decades around `values`, with one decade of head room for the
/// legend and the value labels.
fn log_bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut low, mut high) = (f64::MAX, f64::MIN);
    for v in values.filter(|v| *v > 0.0 && v.is_finite()) {
        low = low.min(v);
        high = high.max(v);
    }
    if low > high {
        return (1.0, 10.0);
    }
    (
        10f64.powf(low.log10().floor()),
        10f64.powf(high.log10().floor() + 2.0),
    )
}

/// An axis value: `100`, `10k`, `1M`, `0.1`.
fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{}k", v / 1e3)
    } else {
        format!("{v}")
    }
}

/// A bar's value in µs, short enough to fit above a narrow bar: `472`, `1.8`.
fn short_us(us: f64) -> String {
    if us < 10.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.0}")
    }
}

/// A bar's rate, short: `597`, `8.4k`, `182k`.
fn short_rate(per_s: f64) -> String {
    if per_s >= 1e4 {
        format!("{:.0}k", per_s / 1e3)
    } else if per_s >= 1e3 {
        format!("{:.1}k", per_s / 1e3)
    } else {
        format!("{per_s:.0}")
    }
}

/// A drawing error as text.
fn err(e: impl Display) -> String {
    format!("cannot draw the chart: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_decades_with_head_room() {
        assert_eq!(log_bounds([3.0, 420.0].into_iter()), (1.0, 10_000.0));
        assert_eq!(log_bounds([0.3].into_iter()), (0.1, 10.0));
        assert_eq!(log_bounds(std::iter::empty()), (1.0, 10.0));
        assert_eq!(si(10_000.0), "10k");
        assert_eq!(si(0.1), "0.1");
        assert_eq!(short_us(1.84), "1.8");
        assert_eq!(short_us(1215.0), "1215");
        assert_eq!(short_rate(88.4), "88");
        assert_eq!(short_rate(8358.0), "8.4k");
        assert_eq!(short_rate(181_805.0), "182k");
    }
}
