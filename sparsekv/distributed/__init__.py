"""Scale-out: replicas of the engine on Ray Serve and the policies that route requests to them."""
