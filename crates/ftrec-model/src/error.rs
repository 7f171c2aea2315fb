use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("invalid model configuration: {0}")]
    Config(String),
    #[error("table {table} does not exist (model has {tables} tables)")]
    NoSuchTable { table: usize, tables: usize },
    #[error("row {row} is out of range for table {table} with {rows} rows")]
    RowOutOfRange { table: usize, row: u64, rows: usize },
    #[error("row data for table {table} has {got} bytes, expected {expected}")]
    RowLength {
        table: usize,
        expected: usize,
        got: usize,
    },
    #[error("batch is inconsistent: {0}")]
    Batch(String),
}
