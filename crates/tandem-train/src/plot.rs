//! `curves.html`: the loss and per-step accuracy curves of a run as a self-contained HTML page
//! with inline SVG (no plotting crate, no scripts).

use std::fmt::Write as _;
use std::path::Path;

use crate::error::TrainError;
use crate::metrics::MetricsLine;

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 300.0;
const MARGIN: f64 = 44.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// A named series of `(x, y)` points.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Points, x increasing.
    pub points: Vec<(f64, f64)>,
    /// Draw markers instead of a line (validation points).
    pub markers: bool,
}

/// Moving average over `window` points (the raw per-step curve is noisy).
pub fn smooth(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let window = window.max(1);
    let mut out = Vec::with_capacity(points.len());
    let mut sum = 0.0;
    for (i, &(x, y)) in points.iter().enumerate() {
        sum += y;
        if i >= window {
            sum -= points[i - window].1;
        }
        out.push((x, sum / (i + 1).min(window) as f64));
    }
    out
}

/// One SVG chart.
pub fn chart(title: &str, y_label: &str, series: &[Series]) -> String {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(
        svg,
        r#"<text x="{}" y="16" text-anchor="middle" font-size="13">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    if all.is_empty() {
        svg.push_str(r#"<text x="50%" y="50%" text-anchor="middle">no data yet</text></svg>"#);
        return svg;
    }
    let (mut x0, mut x1) = (f64::MAX, f64::MIN);
    let (mut y0, mut y1) = (f64::MAX, f64::MIN);
    for &(x, y) in &all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let pad = (y1 - y0) * 0.05;
    let (y0, y1) = (y0 - pad, y1 + pad);
    let sx = |x: f64| MARGIN + (x - x0) / (x1 - x0) * (WIDTH - 2.0 * MARGIN);
    let sy = |y: f64| HEIGHT - MARGIN - (y - y0) / (y1 - y0) * (HEIGHT - 2.0 * MARGIN);
    // Axes and ticks.
    let _ = write!(
        svg,
        r##"<rect x="{MARGIN}" y="{MARGIN}" width="{}" height="{}" fill="none" stroke="#999"/>"##,
        WIDTH - 2.0 * MARGIN,
        HEIGHT - 2.0 * MARGIN
    );
    for k in 0..=4 {
        let fy = y0 + (y1 - y0) * k as f64 / 4.0;
        let fx = x0 + (x1 - x0) * k as f64 / 4.0;
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">{}</text><text x="{}" y="{}" text-anchor="middle">{}</text>"##,
            MARGIN - 4.0,
            sy(fy) + 4.0,
            tick(fy),
            sx(fx),
            HEIGHT - MARGIN + 14.0,
            tick(fx)
        );
    }
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">step</text><text x="12" y="{}" transform="rotate(-90 12 {})" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        HEIGHT - 6.0,
        HEIGHT / 2.0,
        HEIGHT / 2.0,
        escape(y_label)
    );
    for (k, s) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        if s.markers {
            for (x, y) in &pts {
                let _ = write!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                    sx(*x),
                    sy(*y)
                );
            }
        } else {
            let path: Vec<String> = pts
                .iter()
                .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
                path.join(" ")
            );
        }
        let ly = MARGIN + 12.0 + 13.0 * k as f64;
        let _ = write!(
            svg,
            r#"<rect x="{}" y="{}" width="10" height="3" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
            WIDTH - MARGIN - 110.0,
            ly - 4.0,
            WIDTH - MARGIN - 96.0,
            ly,
            escape(&s.label)
        );
    }
    svg.push_str("</svg>");
    svg
}

fn tick(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The page for a run's metrics: total loss (train smoothed + validation), loss_i per step, and
/// acc_i per step (train smoothed + validation markers).
pub fn render(title: &str, lines: &[MetricsLine]) -> String {
    let train: Vec<&MetricsLine> = lines.iter().filter(|l| l.kind == "train").collect();
    let val: Vec<&MetricsLine> = lines.iter().filter(|l| l.kind == "val").collect();
    let steps = train
        .iter()
        .chain(&val)
        .map(|l| l.acc.len())
        .max()
        .unwrap_or(0);
    let window = (train.len() / 50).max(1);
    let pts = |ls: &[&MetricsLine], f: &dyn Fn(&MetricsLine) -> Option<f64>| -> Vec<(f64, f64)> {
        ls.iter()
            .filter_map(|l| f(l).map(|y| (l.step as f64, y)))
            .collect()
    };
    let mut loss = vec![Series {
        label: "train".into(),
        points: smooth(&pts(&train, &|l| Some(l.loss)), window),
        markers: false,
    }];
    if !val.is_empty() {
        loss.push(Series {
            label: "validation".into(),
            points: pts(&val, &|l| Some(l.loss)),
            markers: true,
        });
    }
    let mut ploss = Vec::new();
    let mut acc = Vec::new();
    let mut val_acc = Vec::new();
    for i in 0..steps {
        ploss.push(Series {
            label: format!("loss_{i}"),
            points: smooth(&pts(&train, &|l| l.ploss.get(i).copied()), window),
            markers: false,
        });
        acc.push(Series {
            label: format!("acc_{i}"),
            points: smooth(&pts(&train, &|l| l.acc.get(i).copied()), window),
            markers: false,
        });
        val_acc.push(Series {
            label: format!("val acc_{i}"),
            points: pts(&val, &|l| l.acc.get(i).copied()),
            markers: true,
        });
    }
    let mut html = String::new();
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title></head>\
         <body style=\"font-family:sans-serif\"><h2>{t}</h2>\
         <p>{} train steps, {} validation passes; curves smoothed over {window} steps.</p>\n",
        train.len(),
        val.len(),
        t = escape(title)
    );
    html.push_str(&chart("total loss (sum 0.8^i loss_i)", "loss", &loss));
    html.push('\n');
    html.push_str(&chart("loss per TTT step (train)", "loss_i", &ploss));
    html.push('\n');
    html.push_str(&chart("accuracy per TTT step (train)", "acc_i", &acc));
    html.push('\n');
    if !val.is_empty() {
        html.push_str(&chart(
            "accuracy per TTT step (validation)",
            "acc_i",
            &val_acc,
        ));
        html.push('\n');
    }
    html.push_str("</body></html>\n");
    html
}

/// Writes [`render`] of `lines` to `path`.
pub fn write(path: &Path, title: &str, lines: &[MetricsLine]) -> Result<(), TrainError> {
    std::fs::write(path, render(title, lines)).map_err(TrainError::io("write", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_a_trailing_mean() {
        let p = [(0.0, 1.0), (1.0, 3.0), (2.0, 5.0), (3.0, 7.0)];
        assert_eq!(
            smooth(&p, 2),
            vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]
        );
    }

    #[test]
    fn renders_a_page_with_every_curve() {
        let line = |kind: &str, step: usize, loss: f64| MetricsLine {
            kind: kind.into(),
            step,
            epoch: 0,
            lr: None,
            loss,
            ploss: vec![loss, loss * 1.1],
            acc: vec![0.1 * step as f64, 0.05 * step as f64],
            grad_norm: None,
            tokens: 10,
            tokens_per_s: None,
            elapsed_s: 0.0,
        };
        let lines = vec![
            line("train", 1, 3.0),
            line("train", 2, 2.0),
            line("val", 2, 2.5),
        ];
        let html = render("run <x>", &lines);
        assert!(html.contains("run &lt;x&gt;"));
        assert_eq!(html.matches("<svg").count(), 4);
        assert!(html.contains("acc_1") && html.contains("val acc_0"));
        assert!(html.contains("<polyline") && html.contains("<circle"));
    }
}
