from dsec.rpc.engine import use_fast_engine

use_fast_engine()  # before anything imports grpc

from dsec.gateway.app import main  # noqa: E402

main()
