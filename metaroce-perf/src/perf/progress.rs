//! Progress of a long size: an indicatif bar when stderr is a terminal, otherwise plain
//! lines on stderr, at most one per second and none in a size's first few seconds (so a
//! short run piped into a file or a CI log stays clean, and a long one shows it is alive).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// No line before a size has run this long.
pub const QUIET: Duration = Duration::from_secs(3);
/// At most one line per this interval.
pub const EVERY: Duration = Duration::from_secs(1);

/// What the position counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Iterations (`-n`).
    Iterations,
    /// Milliseconds of a `-D` run.
    Millis,
}

/// The line printer of a non-terminal stderr.
#[derive(Debug)]
pub struct Lines {
    what: String,
    len: u64,
    unit: Unit,
    start: Instant,
    last: Option<Instant>,
    pos: u64,
}

impl Lines {
    pub fn new(what: String, len: u64, unit: Unit, start: Instant) -> Lines {
        Lines {
            what,
            len,
            unit,
            start,
            last: None,
            pos: 0,
        }
    }

    /// Move to `pos` at `now`; the line to print, if one is due.
    pub fn update_at(&mut self, pos: u64, now: Instant) -> Option<String> {
        self.pos = pos;
        let ran = now.saturating_duration_since(self.start);
        if ran < QUIET
            || self
                .last
                .is_some_and(|l| now.saturating_duration_since(l) < EVERY)
        {
            return None;
        }
        self.last = Some(now);
        let pct = if self.len == 0 {
            100.0
        } else {
            (pos as f64 * 100.0 / self.len as f64).min(100.0)
        };
        Some(match self.unit {
            Unit::Iterations => format!(
                " progress {}: {pos}/{} iterations ({pct:.0}%), {:.0} s",
                self.what,
                self.len,
                ran.as_secs_f64()
            ),
            Unit::Millis => format!(
                " progress {}: {:.0}/{:.0} s ({pct:.0}%)",
                self.what,
                pos as f64 / 1e3,
                self.len as f64 / 1e3
            ),
        })
    }
}

/// A size's progress display.
#[derive(Debug)]
pub enum Progress {
    /// Nothing to show.
    Hidden,
    /// stderr is a terminal.
    Bar(ProgressBar),
    /// stderr is a pipe or a file.
    Lines(Lines),
}

impl Progress {
    /// `len` units of `unit`, labelled `what`.
    pub fn new(len: u64, unit: Unit, what: String) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress::Lines(Lines::new(what, len, unit, Instant::now()));
        }
        let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template(" {msg:>14} [{bar:40}] {percent:>3}% {elapsed_precise}")
        {
            pb.set_style(style.progress_chars("=> "));
        }
        pb.set_message(what);
        Progress::Bar(pb)
    }

    /// One more unit.
    pub fn inc(&mut self, n: u64) {
        match self {
            Progress::Hidden => {}
            Progress::Bar(b) => b.inc(n),
            Progress::Lines(l) => {
                let pos = l.pos + n;
                if let Some(line) = l.update_at(pos, Instant::now()) {
                    eprintln!("{line}");
                }
            }
        }
    }

    /// Move to `pos`.
    pub fn set_position(&mut self, pos: u64) {
        match self {
            Progress::Hidden => {}
            Progress::Bar(b) => b.set_position(pos),
            Progress::Lines(l) => {
                if let Some(line) = l.update_at(pos, Instant::now()) {
                    eprintln!("{line}");
                }
            }
        }
    }

    /// The size is done: remove the bar (lines stay).
    pub fn finish_and_clear(&self) {
        if let Progress::Bar(b) = self {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over a 10 s run updated every millisecond: nothing in the first 3 s, then exactly
    /// one line per second.
    #[test]
    fn lines_are_quiet_at_first_then_at_most_one_per_second() {
        let t0 = Instant::now();
        let mut l = Lines::new("65536 B".into(), 10_000, Unit::Iterations, t0);
        let mut printed = Vec::new();
        for ms in 0..10_000u64 {
            if let Some(s) = l.update_at(ms + 1, t0 + Duration::from_millis(ms)) {
                printed.push((ms, s));
            }
        }
        let at: Vec<u64> = printed.iter().map(|p| p.0).collect();
        assert_eq!(at, vec![3000, 4000, 5000, 6000, 7000, 8000, 9000]);
        assert_eq!(
            printed[0].1,
            " progress 65536 B: 3001/10000 iterations (30%), 3 s"
        );
        // A short run prints nothing.
        let mut short = Lines::new("x".into(), 100, Unit::Millis, t0);
        assert!((0..2900).all(|ms| short
            .update_at(ms, t0 + Duration::from_millis(ms))
            .is_none()));
    }
}
