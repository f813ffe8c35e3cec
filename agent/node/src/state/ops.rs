//! Applied operation ids: a command's result is recorded here before it is reported, and a
//! redelivered command is answered from the record instead of being applied again.
use super::{StateError, Store};
use fleet_proto::RunId;
use fleet_proto::protocol::Answer;
use redb::{ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// op id -> `{"result": ANSWER}`; `run-claim:RUN` -> `{"result": {"op": OP}}`.
const OPS: TableDefinition<&str, &[u8]> = TableDefinition::new("ops");
/// Insertion order of op ids, so the oldest are pruned first.
const OP_ORDER: TableDefinition<u64, &str> = TableDefinition::new("op_order");
const META_OP_SEQ: &str = "op_seq";

/// How many applied operations are remembered. The coordinator redelivers only unanswered commands
/// of a live session, so the window only has to outlast a reconnection; a start redelivered later
/// still is refused by the supervisor's run-id claim.
pub const KEEP_OPS: u64 = 10_000;

#[derive(serde::Serialize, serde::Deserialize)]
struct OpRecord<T> {
    result: T,
}

/// Which operation first used a run id.
#[derive(serde::Serialize, serde::Deserialize)]
struct RunClaim {
    op: String,
}

fn claim_key(run_id: &RunId) -> String {
    format!("run-claim:{run_id}")
}

impl Store {
    /// The answer recorded for `op_id`, if that operation was already applied.
    pub fn answer_of(&self, op_id: &str) -> Result<Option<Answer>, StateError> {
        self.applied(op_id)
    }

    /// Records `answer` for `op_id`, durably, before the caller reports it; the first stays.
    pub fn record_answer(&self, op_id: &str, answer: &Answer) -> Result<(), StateError> {
        self.record_applied(op_id, answer)
    }

    /// The operation that first used `run_id`, if one did.
    pub fn run_claim(&self, run_id: &RunId) -> Result<Option<String>, StateError> {
        let claim: Option<RunClaim> = self.applied(&claim_key(run_id))?;
        Ok(claim.map(|c| c.op))
    }

    /// Records that `op` uses `run_id`; a run id already claimed keeps its first operation.
    pub fn claim_run(&self, run_id: &RunId, op: &str) -> Result<(), StateError> {
        let claim = RunClaim { op: op.to_string() };
        self.record_applied(&claim_key(run_id), &claim)
    }

    /// The recorded result of `op_id`, if that operation was already applied.
    pub fn applied<T: DeserializeOwned>(&self, op_id: &str) -> Result<Option<T>, StateError> {
        self.read(|tx| {
            let ops = match tx.open_table(OPS) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(self.fail(e)),
            };
            let Some(bytes) = ops.get(op_id).map_err(|e| self.fail(e))? else {
                return Ok(None);
            };
            let record: OpRecord<T> = serde_json::from_slice(bytes.value())
                .map_err(|e| self.corrupt("operation", op_id, e))?;
            Ok(Some(record.result))
        })
    }

    /// Records `op_id` as applied with `result`, durably, before the caller reports it.
    ///
    /// Recording an id again keeps the first result: the first answer is the one that counts.
    pub fn record_applied<T: Serialize>(&self, op_id: &str, result: &T) -> Result<(), StateError> {
        self.write(|tx| {
            {
                let mut ops = tx.open_table(OPS).map_err(|e| self.fail(e))?;
                if ops.get(op_id).map_err(|e| self.fail(e))?.is_some() {
                    return Ok(());
                }
                let record =
                    // Cannot fail: a result is plain data with string keys, which always serializes.
                    serde_json::to_vec(&OpRecord { result }).expect("a recorded result serializes");
                ops.insert(op_id, record.as_slice())
                    .map_err(|e| self.fail(e))?;
            }
            // Forget the oldest beyond the window, in the same transaction.
            self.remember_in_order(tx, OP_ORDER, OPS, META_OP_SEQ, op_id, KEEP_OPS)
        })
    }
}
