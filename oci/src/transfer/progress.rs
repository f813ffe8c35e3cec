//! Progress bars (overall and per blob) on a terminal; nothing at all otherwise.
use crate::transfer::remote::verify::ByteStream;
use crate::types::digest::Digest;
use futures_util::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// The bars of one transfer; a disabled one draws nothing and costs nothing.
#[derive(Clone)]
pub struct Progress {
    bars: Option<(MultiProgress, ProgressBar)>,
}

impl Progress {
    /// Bars when stderr is a terminal and `quiet` is false.
    pub fn new(total_bytes: u64, quiet: bool) -> Progress {
        if quiet || !std::io::stderr().is_terminal() {
            return Progress { bars: None };
        }
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
        let overall = multi.add(ProgressBar::new(total_bytes));
        overall.set_style(style(
            "{prefix:>12} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
        ));
        overall.set_prefix("total");
        Progress {
            bars: Some((multi, overall)),
        }
    }

    /// Counts a blob's bytes on both its own bar and the overall one as they stream.
    pub fn track(&self, digest: &Digest, size: u64, stream: ByteStream) -> ByteStream {
        let Some((multi, overall)) = &self.bars else {
            return stream;
        };
        let bar = multi.add(ProgressBar::new(size));
        bar.set_style(style("{prefix:>12} [{bar:30}] {bytes}/{total_bytes}"));
        bar.set_prefix(digest.hex()[..12].to_string());
        let overall = overall.clone();
        stream
            .inspect(move |chunk| {
                if let Ok(c) = chunk {
                    bar.inc(c.len() as u64);
                    overall.inc(c.len() as u64);
                    if bar.position() >= size {
                        bar.finish_and_clear();
                    }
                }
            })
            .boxed()
    }

    /// Counts bytes that did not need to move (already there, or mounted).
    pub fn skip(&self, size: u64) {
        if let Some((_, overall)) = &self.bars {
            overall.inc(size);
        }
    }

    /// Removes the bars.
    pub fn finish(&self) {
        if let Some((multi, overall)) = &self.bars {
            overall.finish_and_clear();
            let _ = multi.clear();
        }
    }
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        // Cannot fail: the templates are constants checked by the tests.
        .expect("the templates are valid")
        .progress_chars("=> ")
}
