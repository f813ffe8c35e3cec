//! Applied operation ids: a command's result is recorded here before it is reported, and a
//! redelivered command is answered from the record instead of being applied again.
use super::{StateError, Store};
use redb::{ReadableTable, TableDefinition};

/// The result of an applied command, exactly as it was (or will be) reported.
pub type StoredResult = serde_json::Value;

/// op id -> `{"seq": N, "result": ...}`.
const OPS: TableDefinition<&str, &[u8]> = TableDefinition::new("ops");
/// Insertion order of op ids, so the oldest are pruned first.
const OP_ORDER: TableDefinition<u64, &str> = TableDefinition::new("op_order");
const META_OP_SEQ: &str = "op_seq";

/// How many applied operations are remembered. The coordinator redelivers only unanswered commands
/// of a live session, so the window only has to outlast a reconnection; a start redelivered later
/// still is refused by the supervisor's run-id claim.
pub const KEEP_OPS: u64 = 10_000;

#[derive(serde::Serialize, serde::Deserialize)]
struct OpRecord {
    result: StoredResult,
}

impl Store {
    /// The recorded result of `op_id`, if that operation was already applied.
    pub fn applied(&self, op_id: &str) -> Result<Option<StoredResult>, StateError> {
        self.read(|tx| {
            let ops = match tx.open_table(OPS) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(self.fail(e)),
            };
            let Some(bytes) = ops.get(op_id).map_err(|e| self.fail(e))? else {
                return Ok(None);
            };
            let record: OpRecord = serde_json::from_slice(bytes.value())
                .map_err(|e| self.corrupt("operation", op_id, e))?;
            Ok(Some(record.result))
        })
    }

    /// Records `op_id` as applied with `result`, durably, before the caller reports it.
    ///
    /// Recording an id again keeps the first result: the first answer is the one that counts.
    pub fn record_applied(&self, op_id: &str, result: &StoredResult) -> Result<(), StateError> {
        self.write(|tx| {
            {
                let mut ops = tx.open_table(OPS).map_err(|e| self.fail(e))?;
                if ops.get(op_id).map_err(|e| self.fail(e))?.is_some() {
                    return Ok(());
                }
                let record = serde_json::to_vec(&OpRecord {
                    result: result.clone(),
                })
                .expect("a JSON value serializes");
                ops.insert(op_id, record.as_slice())
                    .map_err(|e| self.fail(e))?;
            }
            // Forget the oldest beyond the window, in the same transaction.
            self.remember_in_order(tx, OP_ORDER, OPS, META_OP_SEQ, op_id, KEEP_OPS)
        })
    }
}
