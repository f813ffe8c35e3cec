//! The watch over one run as a phase machine. [`Watch::step`] decides, with no syscall and no
//! clock of its own; [`drive`] does what it decides through a [`System`]: the real one, or in
//! the tests a fake whose clock only moves when it is polled.
use crate::sys::Ended;
use std::time::{Duration, Instant};

/// How long pipes may stay open after the whole tree is gone (only a process outside the tree
/// that was handed the pipe could hold them).
pub const DRAIN_AFTER_TREE: Duration = Duration::from_secs(1);
/// How often SIGKILL is repeated until no descendant is left.
pub const KILL_EVERY: Duration = Duration::from_millis(20);

/// Why the tree is being terminated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reason {
    Timeout,
    Stop,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Phase {
    /// The program runs, its deadline (if any) ahead.
    Running,
    /// SIGTERM went to the tree at `since`; the grace runs.
    Terminating { since: Instant },
    /// The grace is over: SIGKILL went to the tree at `last_kill`, and repeats until it is empty.
    Killing { last_kill: Instant },
    /// The tree is gone since `since`; the pipes may still hold output.
    Draining { since: Instant },
    /// Nothing is left to watch.
    Done,
}

/// What the record tells of the run's end, filled in as the phases pass.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    /// How the leader ended, once reaped.
    pub ended: Option<Ended>,
    pub reason: Option<Reason>,
    /// How long the tree took to end after SIGTERM: all of the grace when SIGKILL followed.
    pub grace_used: Option<Duration>,
    pub killed: bool,
}

impl Outcome {
    pub fn timed_out(&self) -> bool {
        self.reason == Some(Reason::Timeout)
    }

    pub fn stopped(&self) -> bool {
        self.reason == Some(Reason::Stop)
    }
}

/// What happened, as the loop tells the machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Event {
    /// A wait ended, by its timer or not: the clock is to be looked at.
    Tick,
    /// A signal other than SIGCHLD: `stop` (or anyone) asks the supervisor to end the run.
    Stop,
    /// The leader was reaped, and ended so.
    LeaderEnded(Ended),
    /// This process has no child left.
    NoChildren,
    /// The answer to [`Step::check_tree`]: whether nothing of the tree is left.
    TreeEmpty(bool),
    /// Both pipes reached end of file.
    PipesClosed,
}

/// What the machine asks for after an event.
#[derive(Debug, PartialEq)]
pub struct Step {
    /// A signal for every process of the tree, now.
    pub signal: Option<libc::c_int>,
    /// Whether to ask the tree if it is empty, and tell the answer before anything else.
    pub check_tree: bool,
    /// When to wake at the latest, should nothing happen before (None: no timer runs).
    pub wake: Option<Instant>,
}

/// The state of the watch: its phase and the few facts the phases need.
pub struct Watch {
    pub phase: Phase,
    pub outcome: Outcome,
    deadline: Option<Instant>,
    grace: Duration,
    /// No child of this process is left, though orphans outside our reach as parent may be.
    children_gone: bool,
    pipes_closed: bool,
}

impl Watch {
    pub fn new(deadline: Option<Instant>, grace: Duration) -> Self {
        Self {
            phase: Phase::Running,
            outcome: Outcome::default(),
            deadline,
            grace,
            children_gone: false,
            pipes_closed: false,
        }
    }

    /// The whole decision: what `event`, at `now`, leads to.
    pub fn step(&mut self, now: Instant, event: Event) -> Step {
        let mut signal = None;
        match event {
            // Once no child is left, each wake-up asks the tree first.
            Event::Tick if self.children_gone && self.tree_left() => {
                return Step {
                    signal,
                    check_tree: true,
                    wake: self.wake(now),
                };
            }
            Event::Tick => signal = self.on_time(now),
            Event::TreeEmpty(empty) => {
                if empty {
                    self.tree_gone(now);
                }
                signal = self.on_time(now);
            }
            Event::Stop if self.phase == Phase::Running => {
                signal = Some(self.terminate(Reason::Stop, now));
            }
            Event::Stop => {}
            Event::LeaderEnded(how) => self.outcome.ended = Some(how),
            Event::NoChildren => self.children_gone = true,
            Event::PipesClosed => self.pipes_closed = true,
        }
        Step {
            signal,
            check_tree: false,
            wake: self.wake(now),
        }
    }

    /// Whether anything of the tree may still be there.
    fn tree_left(&self) -> bool {
        matches!(
            self.phase,
            Phase::Running | Phase::Terminating { .. } | Phase::Killing { .. }
        )
    }

    /// The steps the clock drives: the timeout, SIGKILL after the grace (repeated), and the end
    /// of draining.
    fn on_time(&mut self, now: Instant) -> Option<libc::c_int> {
        match self.phase {
            Phase::Running if self.deadline.is_some_and(|d| now >= d) => {
                Some(self.terminate(Reason::Timeout, now))
            }
            Phase::Terminating { since } if now >= since + self.grace => {
                self.outcome.killed = true;
                self.outcome.grace_used = Some(self.grace);
                self.phase = Phase::Killing { last_kill: now };
                Some(libc::SIGKILL)
            }
            Phase::Killing { last_kill } if now >= last_kill + KILL_EVERY => {
                self.phase = Phase::Killing { last_kill: now };
                Some(libc::SIGKILL)
            }
            Phase::Draining { since } if self.pipes_closed || now >= since + DRAIN_AFTER_TREE => {
                self.phase = Phase::Done;
                None
            }
            _ => None,
        }
    }

    fn terminate(&mut self, reason: Reason, now: Instant) -> libc::c_int {
        self.outcome.reason = Some(reason);
        self.phase = Phase::Terminating { since: now };
        libc::SIGTERM
    }

    fn tree_gone(&mut self, now: Instant) {
        if let Phase::Terminating { since } = self.phase {
            self.outcome.grace_used = Some(now.duration_since(since));
        }
        self.phase = Phase::Draining { since: now };
    }

    fn wake(&self, now: Instant) -> Option<Instant> {
        match self.phase {
            Phase::Done => None,
            Phase::Draining { since } => Some(since + DRAIN_AFTER_TREE),
            // Orphans outside our reach as parent: watch the tree empty.
            _ if self.children_gone => Some(now + KILL_EVERY),
            Phase::Running => self.deadline,
            Phase::Terminating { since } => Some(since + self.grace),
            Phase::Killing { last_kill } => Some(last_kill + KILL_EVERY),
        }
    }
}

/// Which of the fds a poll found ready.
pub struct Ready {
    pub signals: bool,
    /// stdout, stderr.
    pub pipes: [bool; 2],
}

/// What reaping every ended child found.
#[derive(Default)]
pub struct Reaped {
    pub leader: Option<Ended>,
    pub no_children: bool,
}

/// The syscalls the watch needs.
pub trait System {
    fn now(&self) -> Instant;
    /// Sends `signal` to every process of the tree.
    fn signal_tree(&mut self, signal: libc::c_int);
    /// Whether nothing of the tree is left, asked once no child is.
    fn tree_is_empty(&mut self) -> bool;
    /// Waits up to `timeout` (None: without end) for a signal, or output on an open pipe.
    fn poll(&mut self, timeout: Option<Duration>) -> Ready;
    /// Reads once from each ready pipe; true once both are closed.
    fn read_pipes(&mut self, ready: [bool; 2]) -> bool;
    /// The next pending signal, if any.
    fn read_signal(&mut self) -> Option<libc::c_int>;
    /// Reaps every child that has ended, without blocking.
    fn reap(&mut self) -> Reaped;
}

/// Runs the watch until its phase is Done.
pub fn drive(watch: &mut Watch, sys: &mut impl System) {
    loop {
        let (now, wake) = tell(watch, sys, Event::Tick);
        if watch.phase == Phase::Done {
            return;
        }
        let ready = sys.poll(wake.map(|w| w.saturating_duration_since(now)));
        if sys.read_pipes(ready.pipes) {
            tell(watch, sys, Event::PipesClosed);
        }
        if ready.signals {
            while let Some(signal) = sys.read_signal() {
                if signal != libc::SIGCHLD {
                    tell(watch, sys, Event::Stop);
                }
            }
            let reaped = sys.reap();
            if let Some(how) = reaped.leader {
                tell(watch, sys, Event::LeaderEnded(how));
            }
            if reaped.no_children {
                tell(watch, sys, Event::NoChildren);
            }
        }
    }
}

/// Tells the machine `event` and does what it asks; returns when it was told, and its wake.
fn tell(watch: &mut Watch, sys: &mut impl System, event: Event) -> (Instant, Option<Instant>) {
    let mut event = event;
    loop {
        let now = sys.now();
        let step = watch.step(now, event);
        if let Some(signal) = step.signal {
            sys.signal_tree(signal);
        }
        if !step.check_tree {
            return (now, step.wake);
        }
        event = Event::TreeEmpty(sys.tree_is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libc::{SIGCHLD, SIGKILL, SIGTERM};

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Who holds the program's pipes open.
    #[derive(Clone, Copy)]
    enum Holder {
        Leader,
        /// The leader and its orphans.
        Tree,
        /// A process outside the tree, until then (None: for good).
        Outsider(Option<Duration>),
    }

    /// A scripted run under paused time: the clock moves only in `poll`, to the first of its
    /// timeout and the next scripted happening. Every time is since `start`.
    struct Fake {
        start: Instant,
        now: Duration,
        /// When and how the leader ends (scripted, or as a signal made it). It is our only child.
        leader_end: Option<(Duration, Ended)>,
        /// How long the leader takes to end after SIGTERM (None: it ignores SIGTERM).
        term_takes: Option<Duration>,
        /// Until when the leader's orphans (in the cgroup, not our children) live by themselves.
        orphans_until: Duration,
        /// How many SIGKILLs the orphans outlive.
        orphans_survive: usize,
        pipes: Holder,
        /// When stop signals arrive.
        stops: Vec<Duration>,
        kills: usize,
        stops_read: usize,
        chld_read: bool,
        reaped: bool,
        pipes_open: bool,
        polls: usize,
        /// Every signal sent to the tree, and when.
        sent: Vec<(Duration, libc::c_int)>,
        /// When the tree was asked whether it is empty.
        checks: Vec<Duration>,
    }

    impl Fake {
        fn new() -> Self {
            Self {
                start: Instant::now(),
                now: Duration::ZERO,
                leader_end: None,
                term_takes: None,
                orphans_until: Duration::ZERO,
                orphans_survive: 0,
                pipes: Holder::Leader,
                stops: Vec::new(),
                kills: 0,
                stops_read: 0,
                chld_read: false,
                reaped: false,
                pipes_open: true,
                polls: 0,
                sent: Vec::new(),
                checks: Vec::new(),
            }
        }

        /// Watches the script to its end; returns the outcome.
        fn watch(&mut self, timeout: Option<Duration>, grace: Duration) -> Outcome {
            let mut watch = Watch::new(timeout.map(|t| self.start + t), grace);
            drive(&mut watch, self);
            watch.outcome
        }

        fn end_leader(&mut self, at: Duration, how: Ended) {
            if self.leader_end.is_none_or(|(end, _)| end > at) {
                self.leader_end = Some((at, how));
            }
        }

        fn leader_gone(&self) -> bool {
            self.leader_end.is_some_and(|(at, _)| at <= self.now)
        }

        fn pipes_close_at(&self) -> Option<Duration> {
            let leader = self.leader_end.map(|(at, _)| at);
            match self.pipes {
                Holder::Leader => leader,
                Holder::Tree => leader.map(|at| at.max(self.orphans_until)),
                Holder::Outsider(at) => at,
            }
        }

        fn stop_due(&self) -> bool {
            self.stops
                .get(self.stops_read)
                .is_some_and(|&at| at <= self.now)
        }

        fn ready(&self) -> Ready {
            let closed = self.pipes_open && self.pipes_close_at().is_some_and(|at| at <= self.now);
            Ready {
                signals: self.stop_due() || (self.leader_gone() && !self.chld_read),
                pipes: [closed; 2],
            }
        }
    }

    impl System for Fake {
        fn now(&self) -> Instant {
            self.start + self.now
        }

        fn signal_tree(&mut self, signal: libc::c_int) {
            self.sent.push((self.now, signal));
            if signal == SIGKILL {
                self.kills += 1;
                if self.kills > self.orphans_survive {
                    self.orphans_until = self.orphans_until.min(self.now);
                }
                self.end_leader(self.now, Ended::Signal(SIGKILL));
            } else if let Some(takes) = self.term_takes {
                self.end_leader(self.now + takes, Ended::Signal(SIGTERM));
            }
        }

        fn tree_is_empty(&mut self) -> bool {
            self.checks.push(self.now);
            self.leader_gone() && self.now >= self.orphans_until
        }

        fn poll(&mut self, timeout: Option<Duration>) -> Ready {
            self.polls += 1;
            assert!(self.polls < 1000, "the watch does not end");
            let ready = self.ready();
            if !ready.signals && !ready.pipes.contains(&true) {
                let timer = timeout.map(|t| self.now + t);
                let next = [
                    self.leader_end.map(|(at, _)| at),
                    self.pipes_close_at(),
                    self.stops.get(self.stops_read).copied(),
                ];
                self.now = next
                    .into_iter()
                    .flatten()
                    .filter(|&at| at > self.now)
                    .chain(timer)
                    .min()
                    .expect("the fake would wait for ever");
            }
            self.ready()
        }

        fn read_pipes(&mut self, ready: [bool; 2]) -> bool {
            if ready.contains(&true) {
                self.pipes_open = false;
            }
            !self.pipes_open
        }

        fn read_signal(&mut self) -> Option<libc::c_int> {
            if self.stop_due() {
                self.stops_read += 1;
                return Some(SIGTERM);
            }
            if self.leader_gone() && !self.chld_read {
                self.chld_read = true;
                return Some(SIGCHLD);
            }
            None
        }

        fn reap(&mut self) -> Reaped {
            if !self.leader_gone() {
                return Reaped::default();
            }
            let first = !std::mem::replace(&mut self.reaped, true);
            Reaped {
                leader: self.leader_end.filter(|_| first).map(|(_, how)| how),
                no_children: true,
            }
        }
    }

    #[test]
    fn a_program_that_exits_before_its_timeout_is_neither_signalled_nor_timed_out() {
        let mut fake = Fake {
            leader_end: Some((ms(100), Ended::Code(3))),
            ..Fake::new()
        };
        let outcome = fake.watch(Some(ms(1000)), ms(500));
        assert_eq!(fake.sent, []);
        assert_eq!(
            outcome,
            Outcome {
                ended: Some(Ended::Code(3)),
                ..Outcome::default()
            }
        );
        assert!(!outcome.timed_out() && !outcome.stopped());
        // Both pipes closed with the leader: no draining wait.
        assert_eq!(fake.now, ms(100));
    }

    #[test]
    fn at_the_deadline_sigterm_then_after_exactly_the_grace_sigkill_every_20_ms_until_empty() {
        // The leader ignores SIGTERM; its orphans in the cgroup outlive two SIGKILLs and hold
        // the pipes.
        let mut fake = Fake {
            orphans_until: Duration::MAX,
            orphans_survive: 2,
            pipes: Holder::Tree,
            ..Fake::new()
        };
        let outcome = fake.watch(Some(ms(500)), ms(500));
        let kill = |at| (ms(at), SIGKILL);
        assert_eq!(
            fake.sent,
            [(ms(500), SIGTERM), kill(1000), kill(1020), kill(1040)]
        );
        assert_eq!(
            outcome,
            Outcome {
                ended: Some(Ended::Signal(SIGKILL)),
                reason: Some(Reason::Timeout),
                grace_used: Some(ms(500)),
                killed: true,
            }
        );
        assert!(outcome.timed_out() && !outcome.stopped());
        // Asked at each wake-up once the leader was reaped, the last after the pipes closed.
        assert_eq!(fake.checks, [ms(1000), ms(1020), ms(1040), ms(1040)]);
        assert_eq!(fake.now, ms(1040));
    }

    #[test]
    fn a_tree_that_ends_in_the_grace_after_sigterm_gets_no_sigkill_and_grace_used_is_its_time() {
        let mut fake = Fake {
            term_takes: Some(ms(130)),
            ..Fake::new()
        };
        let outcome = fake.watch(Some(ms(300)), ms(5000));
        assert_eq!(fake.sent, [(ms(300), SIGTERM)]);
        assert_eq!(
            outcome,
            Outcome {
                ended: Some(Ended::Signal(SIGTERM)),
                reason: Some(Reason::Timeout),
                grace_used: Some(ms(130)),
                killed: false,
            }
        );
        assert_eq!(fake.now, ms(430));
    }

    #[test]
    fn a_stop_signal_terminates_for_reason_stop_and_a_second_does_not_restart_the_grace() {
        let mut fake = Fake {
            stops: vec![ms(100), ms(300)],
            ..Fake::new()
        };
        let outcome = fake.watch(Some(ms(10_000)), ms(500));
        // The grace counts from the first stop: SIGKILL at 100 + 500 ms, and only one SIGTERM.
        assert_eq!(fake.sent, [(ms(100), SIGTERM), (ms(600), SIGKILL)]);
        assert_eq!(
            outcome,
            Outcome {
                ended: Some(Ended::Signal(SIGKILL)),
                reason: Some(Reason::Stop),
                grace_used: Some(ms(500)),
                killed: true,
            }
        );
        assert!(outcome.stopped() && !outcome.timed_out());
        assert_eq!(fake.stops_read, 2);
        assert_eq!(fake.now, ms(600));
    }

    #[test]
    fn after_the_tree_is_gone_pipes_held_open_elsewhere_are_drained_for_at_most_a_second() {
        let mut fake = Fake {
            leader_end: Some((ms(200), Ended::Code(0))),
            pipes: Holder::Outsider(None),
            ..Fake::new()
        };
        let outcome = fake.watch(None, ms(500));
        assert_eq!(fake.now, ms(200) + DRAIN_AFTER_TREE);
        assert!(fake.pipes_open);
        assert_eq!(fake.sent, []);
        assert_eq!(outcome.ended, Some(Ended::Code(0)));
    }

    #[test]
    fn draining_ends_as_soon_as_both_pipes_close() {
        let mut fake = Fake {
            leader_end: Some((ms(200), Ended::Code(0))),
            pipes: Holder::Outsider(Some(ms(500))),
            ..Fake::new()
        };
        fake.watch(None, ms(500));
        assert_eq!(fake.now, ms(500));
        assert!(!fake.pipes_open);
    }

    #[test]
    fn orphans_outside_our_children_are_watched_every_20_ms_until_the_tree_is_empty() {
        // No subreaper: the leader is our only child, its orphans stay in the cgroup.
        let mut fake = Fake {
            leader_end: Some((ms(100), Ended::Code(0))),
            orphans_until: ms(150),
            ..Fake::new()
        };
        let outcome = fake.watch(None, ms(500));
        assert_eq!(fake.checks, [ms(100), ms(120), ms(140), ms(160)]);
        assert_eq!(fake.sent, []);
        assert_eq!(outcome.ended, Some(Ended::Code(0)));
        assert_eq!(fake.now, ms(160));
    }

    #[test]
    fn the_step_alone_ignores_a_stop_once_the_tree_is_gone() {
        let start = Instant::now();
        let mut watch = Watch::new(None, ms(500));
        for event in [Event::LeaderEnded(Ended::Code(0)), Event::NoChildren] {
            watch.step(start, event);
        }
        let asked = watch.step(start, Event::Tick);
        assert!(asked.check_tree && asked.signal.is_none());
        watch.step(start, Event::TreeEmpty(true));
        assert_eq!(watch.phase, Phase::Draining { since: start });
        let later = start + ms(10);
        let step = watch.step(later, Event::Stop);
        assert_eq!(
            step,
            Step {
                signal: None,
                check_tree: false,
                wake: Some(start + DRAIN_AFTER_TREE),
            }
        );
        assert_eq!(watch.outcome.reason, None);
    }
}
