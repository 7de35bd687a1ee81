"""The ServerApp's side: the strategies (`strategy`, `server_path`), group membership (`membership`), bounded
message exchange with the Grid (`grid`), round records and run outputs (`records`), and the server path's streaming
aggregation (`aggregation`)."""
