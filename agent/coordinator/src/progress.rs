//! Progress on a terminal for the operator's long commands (`release add`, `rollout status
//! --watch`); where stderr is not a terminal, nothing is drawn and the bars cost nothing.
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;

pub struct Progress(Option<MultiProgress>);

impl Progress {
    /// Bars on stderr when it is a terminal.
    pub fn on_terminal() -> Progress {
        match std::io::stderr().is_terminal() {
            true => Progress(Some(MultiProgress::with_draw_target(
                ProgressDrawTarget::stderr(),
            ))),
            false => Progress::none(),
        }
    }

    pub fn none() -> Progress {
        Progress(None)
    }

    pub fn drawn(&self) -> bool {
        self.0.is_some()
    }

    /// A bar of `total` bytes named `name`.
    pub fn bytes(&self, name: &str, total: u64) -> ProgressBar {
        let bar = self.add(ProgressBar::new(total));
        bar.set_style(style(
            "{prefix:>24} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
        ));
        bar.set_prefix(name.to_string());
        bar
    }

    /// A spinner saying `message` until it is finished.
    pub fn spinner(&self, message: impl Into<String>) -> ProgressBar {
        let bar = self.add(ProgressBar::new_spinner());
        bar.set_style(style("{spinner} {msg} ({elapsed})"));
        bar.set_message(message.into());
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }

    /// A bar of `total` machines, its message the state.
    pub fn machines(&self, total: u64) -> ProgressBar {
        let bar = self.add(ProgressBar::new(total));
        bar.set_style(style("[{bar:30}] {pos}/{len} {msg}"));
        bar
    }

    fn add(&self, bar: ProgressBar) -> ProgressBar {
        match &self.0 {
            Some(multi) => multi.add(bar),
            None => ProgressBar::hidden(),
        }
    }
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        // Cannot fail: the templates are constants, each drawn by the test below.
        .expect("the templates are valid")
        .progress_chars("=> ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bar_draws_and_none_is_drawn_off_a_terminal() {
        let off = Progress::none();
        assert!(!off.drawn());
        assert!(off.bytes("hub-linux-x86_64.tar.gz", 10).is_hidden());
        // Drawn into a hidden target: the templates parse and render.
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::hidden());
        let on = Progress(Some(multi));
        on.bytes("hub-linux-x86_64.tar.gz", 10).inc(5);
        on.spinner("checking").finish_and_clear();
        on.machines(3).set_message("running");
    }
}
