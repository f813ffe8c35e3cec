//! What a serving coordinator holds only in memory, each part owned by one type that alone
//! changes it: the sessions held here, heartbeats not written yet, registry credentials until
//! their node takes the run, artifact tickets, collects under way, the fleet's coordinators as
//! last read, the content bytes moved, the failed joins by source, and the stages in flight. The rest of the coordinator asks them.
mod beats;
mod credentials;
mod fleet;
mod guarded;
mod joins;
mod pulls;
mod sessions;
mod tickets;
mod traffic;
mod uploads;
mod window;

pub(crate) use beats::{Beats, beat_now};
pub(crate) use credentials::Credentials;
pub(crate) use fleet::FleetView;
pub(crate) use joins::{Admission, JoinLimits};
pub(crate) use pulls::Pulls;
pub(crate) use sessions::{NodeCall, SessionHandle, Sessions, Wake};
pub use tickets::TicketRefusal;
pub(crate) use tickets::Tickets;
pub(crate) use traffic::Traffic;
pub(crate) use uploads::Uploads;
pub use window::DEFAULT_FETCH_WINDOW;
pub(crate) use window::{FetchSlot, FetchWindow};
