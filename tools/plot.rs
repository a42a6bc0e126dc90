//! `fluxgate bench --plot FILE.svg`: latency by percentile, as HdrHistogram's plotter draws a
//! `.hgrm` file: the x axis is 1/(1 - percentile) on a log scale (0%, 90%, 99%, 99.9%, ...),
//! so the tail gets as much room as the median; the y axis is the latency in µs.

use std::path::Path;

use hdrhistogram::Histogram;
use plotters::prelude::*;

/// Decades of 1/(1 - p) the x axis shows at least (up to 99.99%).
const MIN_DECADES: f64 = 4.0;

/// The points of one histogram (ns) in plot space: (log10(1/(1 - p)), µs), the maximum at the
/// axis' right end. `decades` is the axis' length.
pub fn points(histogram: &Histogram<u64>, decades: f64) -> Vec<(f64, f64)> {
    let mut points = Vec::new();
    if histogram.is_empty() {
        return points;
    }
    for step in histogram.iter_quantiles(5) {
        let quantile = step.quantile_iterated_to();
        let x = if quantile < 1.0 {
            (1.0 / (1.0 - quantile)).log10().min(decades)
        } else {
            decades
        };
        points.push((x, step.value_iterated_to() as f64 / 1000.0));
    }
    points.push((decades, histogram.max() as f64 / 1000.0));
    points
}

/// Decades the x axis needs: enough that the last sample's percentile fits (n samples reach
/// 1 - 1/n), and at least up to 99.99%.
pub fn decades(histograms: &[(&str, &Histogram<u64>)]) -> f64 {
    histograms
        .iter()
        .map(|(_, h)| (h.len().max(1) as f64).log10().ceil())
        .fold(MIN_DECADES, f64::max)
}

/// The tick label at `x` decades: 0%, 90%, 99%, 99.9%, ...
pub fn percentile_label(x: f64) -> String {
    let decades = x.round();
    if (x - decades).abs() > 1e-6 {
        return String::new();
    }
    let percent = 100.0 * (1.0 - 10f64.powf(-decades));
    format!("{percent:.*}%", (decades as usize).saturating_sub(2))
}

/// Writes the SVG plot of `histograms` (name, latencies in ns) to `path`.
pub fn write_svg(
    path: &Path,
    title: &str,
    histograms: &[(&str, &Histogram<u64>)],
) -> Result<(), String> {
    draw(path, title, histograms).map_err(|e| format!("plotting {}: {e}", path.display()))
}

fn draw(
    path: &Path,
    title: &str,
    histograms: &[(&str, &Histogram<u64>)],
) -> Result<(), Box<dyn std::error::Error>> {
    let decades = decades(histograms);
    let series: Vec<(&str, Vec<(f64, f64)>)> = histograms
        .iter()
        .map(|(name, h)| (*name, points(h, decades)))
        .collect();
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.1))
        .fold(1.0, f64::max)
        * 1.05;
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .margin_right(40)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..decades, 0.0..top)?;
    chart
        .configure_mesh()
        .x_labels(decades as usize + 1)
        .x_label_formatter(&|x| percentile_label(*x))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("percentile")
        .y_desc("latency (µs)")
        .draw()?;
    let colors = [BLUE, RED, GREEN, MAGENTA];
    for (index, (name, points)) in series.into_iter().enumerate() {
        let color = colors[index % colors.len()];
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_nines() {
        let labels: Vec<String> = (0..6).map(|x| percentile_label(x as f64)).collect();
        assert_eq!(labels, ["0%", "90%", "99%", "99.9%", "99.99%", "99.999%"]);
        assert_eq!(percentile_label(1.5), "");
    }

    #[test]
    fn points_climb_to_the_max_at_the_right_end() {
        let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
        for ns in 1..=100_000u64 {
            histogram.record(ns * 10).unwrap();
        }
        let decades = decades(&[("h", &histogram)]);
        assert_eq!(decades, 5.0);
        let points = points(&histogram, decades);
        assert!(points
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        assert_eq!(points[0].0, 0.0);
        let last = points.last().unwrap();
        assert_eq!(*last, (5.0, histogram.max() as f64 / 1000.0));
        // The median sits at 1/(1 - 0.5) = 2: log10(2) decades, ~500 µs.
        let median = points.iter().find(|p| p.0 >= 2f64.log10() - 1e-9).unwrap();
        assert!((median.1 - 500.0).abs() < 5.0, "{median:?}");
    }
}
